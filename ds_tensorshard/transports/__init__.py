"""The transports the data path's collectives run on: the protocol, torch (deepspeed.comm), mpi (mpi4py),
and the deadline every wait has."""
