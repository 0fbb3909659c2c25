"""A script with no ds_tensorshard import, as DeepSpeed's own tests are, run by
tests/multiprocess/test_deepspeed_suite.py under the DeepSpeed-suite site hook (tests/helpers/deepspeed_suite/site):
one rank builds a ZeRO engine of STAGE (with ``odd`` an allgather_bucket_size stock refuses; with ``init`` the model
built under ``deepspeed.zero.Init`` with the same config, given as a file's path) and takes one step.

Usage (RANK=0, WORLD_SIZE=1, MASTER_* set): python suite_engine_worker.py STAGE [odd|init]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import deepspeed
import torch


def main() -> None:
    stage, odd, init = int(sys.argv[1]), sys.argv[2:] == ["odd"], sys.argv[2:] == ["init"]
    deepspeed.init_distributed(dist_backend="gloo", distributed_port=int(os.environ["MASTER_PORT"]))
    zero = {"stage": stage, **({"allgather_bucket_size": 1001} if odd else {})}
    config = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero}
    if init:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(config, f)
        with deepspeed.zero.Init(config_dict_or_path=f.name):
            model = torch.nn.Linear(4, 2)
        os.unlink(f.name)
    else:
        model = torch.nn.Linear(4, 2)
    try:
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    except AssertionError as err:  # stock's (and ds_tensorshard's) refusal of the odd bucket size
        print(f"refused: {type(err).__name__}: {err}")
        return
    engine.backward(engine(torch.randn(2, 4)).sum())
    engine.step()
    print(f"optimizer: {type(engine.optimizer).__name__}")


if __name__ == "__main__":
    main()
