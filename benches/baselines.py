"""The peer encoders the benchmarks compare against; they live in the package (``deltasync_rs._peers``) so that
``deltasync bench`` runs the same code. See that module for what each one does."""

from deltasync_rs._peers import (  # noqa: F401
    grail_like_apply,
    grail_like_encode,
    read_floor,
    scatter_apply,
    trl_v1_apply,
    trl_v1_decode_positions,
    trl_v1_encode,
    trl_v3_apply,
    trl_v3_encode,
)
