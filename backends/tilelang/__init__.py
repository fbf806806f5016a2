"""The TileLang backend (`--backend tilelang`): TileLang generates tile code for the schedule,
composed into the CUDA backend's persistent skeleton as `__device__` functions, so that the
artifact is still one `__global__` in one cubin with the CUDA backend's task table, parameter
block and runtime. docs/backends.md explains the choice and what TileLang could not express.

TileLang is optional and pinned (`requirement.py`); nothing here imports it at module import.
"""
