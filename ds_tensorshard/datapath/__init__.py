"""The data path, one module a phase: plan (ownership) -> buckets -> reduce (onto owners) -> update (the
inner optimizer on owned masters; inner_optimizer says which are accepted) -> norm (global norm, overflow,
clip) -> broadcast (owners send updated tensors back)."""
