"""Launch plans of the fused indexer (`indexer.flash_index_logits`): how a key tile meets the
queries (`DotPlan`), which FP8 path a launch takes (`Fp8Mode`) and its block sizes, warps and
programs per SM (`launch_config`). Pure Python (no Triton): the launcher and the benchmarks
read it, and tests check it without the interpreter.

FP8 keys with 16-bit q take one of several paths (`Fp8Mode`: where the FP8 tile is converted,
which dot operand it is, or fp8 x fp8 dots with q in two e4m3 parts), chosen by
`FP8_DECODE_MODE` / `FP8_PREFILL_MODE`; each has its launch defaults in `ONE_DOT_LAUNCH`.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import torch

from .indexer_reference import FP4_DTYPE, FP8_DTYPES
from .rows import PoolRows

#: q dtypes that dot in their own 16 bits
DOT_16 = (torch.bfloat16, torch.float16)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":  # pragma: no cover - needs a GPU
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


class DotPlan(NamedTuple):
    """How a key tile meets the queries: ``q_parts`` x ``k_parts`` bf16 parts (1 x 1: one dot
    in ``dtype``, q's 16-bit dtype); ``q_parts == 0``: fp32 operands (`INTERPRETER_PLAN`).
    Every plan accumulates exact products in fp32."""

    q_parts: int
    k_parts: int
    dtype: torch.dtype


# FP4 keys (uint8 codes): unpacked times their block scales, exact in bf16 (not in fp16)
_PARTS = {torch.bfloat16: 1, torch.float8_e4m3fn: 1, FP4_DTYPE: 1, torch.float16: 2,
          torch.float32: 3}  # fmt: skip
# The interpreter's 16-bit arithmetic is unreliable (KERNELS.md): there, fp32 dots only.
INTERPRETER_PLAN = DotPlan(0, 0, torch.float32)


def dot_plan(q_dtype: torch.dtype, key_dtype: torch.dtype) -> DotPlan:
    """The GPU plan: 16-bit q with keys of its dtype (or FP8, exact in it), bf16 q with FP4
    keys (their scaled values are exact in bf16): one dot in that dtype; other mixes: fp32 (3
    parts), fp16 (2) and bf16 / FP8 / FP4 (1) operands split into bf16 parts. Raises
    `KeyError` for other dtypes."""
    if q_dtype in DOT_16 and (key_dtype == q_dtype or key_dtype in FP8_DTYPES):
        return DotPlan(1, 1, q_dtype)
    if q_dtype == torch.bfloat16 and key_dtype == FP4_DTYPE:
        return DotPlan(1, 1, q_dtype)
    return DotPlan(_PARTS[q_dtype], _PARTS[key_dtype], torch.bfloat16)


class Fp8Mode(enum.IntEnum):
    """How FP8 keys meet 16-bit queries on the GPU (every other dtype mix: `DOT_A`, through
    its `dot_plan`). All but `FP8_DOT` are exact to fp32 rounding, as the reference. What the
    compiler makes of each (Triton 3.6, sm_90a):

    * ``DOT_A``: the key tile is the dot's A operand, cast to q's dtype as it is read: the
      FP8 tile stays in shared memory (8-byte async copies, one buffer below 5 stages) and is
      read into the dot-operand registers two bytes at a time, converted there.
    * ``KEYS_B``: keys the B operand (``Q (BQ*H, d) @ K^T``, heads on rows): converted to
      q's dtype in registers and stored so to shared memory, from where the wgmma reads them
      (B always comes from shared memory); 16-byte async copies. The head sum crosses the
      warps of a warp group.
    * ``STAGED``: keys the A operand, converted one tile ahead and carried through the loop:
      the compiler stages a loop-carried operand in shared memory as it does a loaded one, and
      the wgmma reads it there. The next tile's 16-byte loads (into registers) are in flight
      over the current dot; at decode the table is read two tiles ahead.
    * ``STAGED_F16``: ``STAGED`` in fp16 (e4m3 -> fp16 is one instruction per two values,
      bf16 three), q scaled per (query, head) by a power of two into fp16's top binade: bf16
      values there are exact in fp16 (the scale moves to ``w``).
    * ``FP8_DOT``: no conversion: q as two e4m3 parts ``p1 + p2 / 16`` per (query, head) (a
      power-of-two scale; bf16-exact but for entries below 2**-14 of the largest),
      interleaved along N: one fp8 x fp8 dot straight from the loaded tile. Hopper adds FP8
      products in fewer bits than fp32: approximate (``bench/indexer.py`` reports the error).
    * ``FP8_Q``: q itself rounded to e4m3 (per query head, by a power of two into the top
      binade 2**7), one fp8 x fp8 dot straight from the loaded tile: half ``FP8_DOT``'s
      columns. A different function, not an approximation of the others: V4's FP8 indexer
      (q and keys e4m3), the reference's ``fp8_q`` (`kernels.index_logits` takes it for FP8
      keys); the products are added by Hopper's FP8 accumulation as in ``FP8_DOT``.
    """

    DOT_A = 0
    KEYS_B = 1
    STAGED = 2
    STAGED_F16 = 3
    FP8_DOT = 4
    FP8_Q = 5

    @property
    def key_operand(self) -> int:
        """The kernel's ``KEY_OPERAND``: 0 A, 1 B, 2 A converted a tile ahead."""
        return {Fp8Mode.KEYS_B: 1, Fp8Mode.STAGED: 2, Fp8Mode.STAGED_F16: 2}.get(self, 0)

    @property
    def q_format(self) -> int:
        """The kernel's ``Q_FORMAT``: 0 q's plan, 1 scaled fp16, 2 two e4m3 parts, 3 q rounded
        to e4m3."""
        return {Fp8Mode.STAGED_F16: 1, Fp8Mode.FP8_DOT: 2, Fp8Mode.FP8_Q: 3}.get(self, 0)


# The FP8 paths in use: the fastest exact ones of bench/indexer.py --fp8-candidates on the H200
# (bench/results/indexer_fp8_candidates_h200.json), µs in a graph: decode STAGED_F16 24.9 at
# B 1 and 570 at B 32 x 262,144 entries (bf16 keys 22.5 / 572; DOT_A 28.2 / 727); prefill
# STAGED 2,378 for 2,048 x 32,768 (bf16 2,061; DOT_A 4,788). FP8_DOT (approximate, 1.2e-4 rel
# L2: 464 at B 32) is no default.
FP8_DECODE_MODE = Fp8Mode.STAGED_F16
FP8_PREFILL_MODE = Fp8Mode.STAGED

#: Decode launches over at least this many rows per request look for a prefix of rows every
#: request shares (`rows.shared_prefix_rows`) and read it once for all (``shared_prefix`` knob).
SHARED_PREFIX_MIN_ROWS = 8192


class Launch(NamedTuple):
    """Defaults of one kind of launch (`launch_config`)."""

    block_q: int
    block_e: int
    num_warps: int
    per_sm: int  # programs per SM in the one wave
    num_stages: int
    maxnreg: int | None = None  # registers per thread (None: as the compiler likes)


# 16-bit keys, DOT_A: measured on an H200 (bench/results/indexer_h200.json): 16-bit decode
# 64-row tiles, 4 warps, 4 programs per SM (50 KB of shared memory each); FP8 decode 128
# rows, 8 warps, 2 per SM; prefill 4 queries x 64 rows, 8 warps (2 per SM: but FP8 DOT_A
# compiles to 171 registers a thread, so only one is resident). The other FP8 modes: first
# guesses from their compiled registers and shared memory (Triton 3.6, sm_90a: 128 registers
# x 8 warps leave room for 2 programs per SM; ``maxnreg`` holds ptxas there), until measured.
ONE_DOT_LAUNCH = {  # (shared, FP8 mode or None: 16-bit keys)
    (False, None): Launch(1, 64, 4, 4, 3),
    (True, None): Launch(4, 64, 8, 2, 3),
    (False, Fp8Mode.DOT_A): Launch(1, 128, 8, 2, 3),
    (True, Fp8Mode.DOT_A): Launch(4, 64, 8, 2, 3),
    (False, Fp8Mode.KEYS_B): Launch(1, 128, 4, 3, 3),
    (True, Fp8Mode.KEYS_B): Launch(4, 64, 8, 2, 3, 128),
    (False, Fp8Mode.STAGED): Launch(1, 128, 8, 2, 3),
    (True, Fp8Mode.STAGED): Launch(4, 64, 8, 2, 3, 128),
    (False, Fp8Mode.STAGED_F16): Launch(1, 128, 8, 3, 3, 80),  # measured best
    (True, Fp8Mode.STAGED_F16): Launch(4, 64, 8, 2, 3, 128),
    (False, Fp8Mode.FP8_DOT): Launch(1, 128, 8, 2, 4),
    (True, Fp8Mode.FP8_DOT): Launch(2, 64, 8, 2, 3, 128),
    # FP8_Q: FP8_DOT's best decode launch (5 stages); prefill as 16-bit keys (same columns)
    (False, Fp8Mode.FP8_Q): Launch(1, 128, 8, 2, 5),
    (True, Fp8Mode.FP8_Q): Launch(4, 64, 8, 2, 3),
}
# FP4 keys (by shared), unmeasured: compiled without a GPU (Triton 3.9, sm_90a), decode 128
# rows x 8 warps take 152 registers a thread, one program per SM (FP8 DOT_A's defaults would
# run in two waves); 64 rows x 4 warps 152, three per SM. Prefill: FP8 DOT_A's (167, as 169).
FP4_LAUNCH = {False: Launch(1, 64, 4, 3, 3), True: ONE_DOT_LAUNCH[(True, Fp8Mode.DOT_A)]}


def fp8_mode_for(
    q_dtype: torch.dtype, key_dtype: torch.dtype, shared: bool, requested: Fp8Mode | None = None
) -> Fp8Mode:
    """The FP8 path of a launch: ``requested``, else `FP8_PREFILL_MODE` (``shared``) or
    `FP8_DECODE_MODE` for FP8 keys with 16-bit q, else ``DOT_A`` (the other mixes have no
    choice). ``FP8_DOT`` needs bf16 q (its two e4m3 parts hold 8 of fp16's 11 bits): a
    default of ``FP8_DOT`` gives fp16 q ``DOT_A``. ``FP8_Q`` (q rounded to e4m3: any float q)
    is only ever requested. Raises `ValueError` for a requested mode other than ``DOT_A`` that
    does not apply."""
    applies = key_dtype in FP8_DTYPES and q_dtype in DOT_16
    if requested is None:
        mode = (FP8_PREFILL_MODE if shared else FP8_DECODE_MODE) if applies else Fp8Mode.DOT_A
        return Fp8Mode.DOT_A if mode == Fp8Mode.FP8_DOT and q_dtype != torch.bfloat16 else mode
    requested = Fp8Mode(requested)
    if requested == Fp8Mode.FP8_Q:
        if key_dtype not in FP8_DTYPES or q_dtype not in DOT_16 + (torch.float32,):
            raise ValueError("fp8_mode FP8_Q needs FP8 keys and bf16/fp16/fp32 q")
        return requested
    if requested != Fp8Mode.DOT_A and not applies:
        raise ValueError(f"fp8_mode {requested.name} needs FP8 keys and 16-bit q")
    if requested == Fp8Mode.FP8_DOT and q_dtype != torch.bfloat16:
        raise ValueError("fp8_mode FP8_DOT needs bf16 q (two e4m3 parts hold 8 bits)")
    return requested


def launch_config(
    n: int,
    g: int,
    shared: bool,
    key_bytes: int,
    plan: DotPlan,
    device: torch.device,
    *,
    fp8_mode: Fp8Mode = Fp8Mode.DOT_A,
    fp4: bool = False,
    block_q: int | None = None,
    block_e: int | None = None,
    span: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    per_sm: int | None = None,
    maxnreg: int | None = None,
) -> dict:
    """The launch of ``n`` queries over ``g`` rows (``shared``: queries carry ``qrow``) with
    keys of ``key_bytes`` (1: FP8, through ``fp8_mode``; ``fp4``: FP4 codes, one dot with
    `FP4_LAUNCH`): ``BLOCK_Q``, ``BLOCK_E``, ``span`` (rows per program, a multiple of
    ``BLOCK_E``), ``num_warps``, ``num_stages``, ``maxnreg`` (None: the compiler's choice),
    ``fp8_mode``; the keyword knobs override the defaults (benchmark sweeps). Without sharing
    a program takes one query; rows are split so that up to ``per_sm`` programs per SM (by
    default as many as are resident at once) run in one wave. Raises `ValueError` for block
    sizes that are not powers of two of at least 16 rows (``tl.dot``)."""
    if plan.q_parts * plan.k_parts <= 1 and fp4:
        dft = FP4_LAUNCH[shared]
    elif plan.q_parts * plan.k_parts <= 1:
        dft = ONE_DOT_LAUNCH[(shared, Fp8Mode(fp8_mode) if key_bytes == 1 else None)]
    else:  # several dots from split operands: fewer queries per tile (registers, shared memory)
        bq = 2 if shared and plan.k_parts == 1 else 1
        dft = Launch(bq, 64, 8 if bq > 1 else 4, 2, 2)
    bq, be = block_q or dft.block_q, block_e or dft.block_e
    if bq & (bq - 1) or be & (be - 1) or be < 16 or (not shared and bq != 1):
        raise ValueError(f"bad block sizes: block_q {bq}, block_e {be} (queries without qrow: 1)")
    blocks = _cdiv(max(n, 1), bq)
    tiles = _cdiv(max(g, 1), be)
    if span is None:
        # at most one wave: a second, partial wave of equal programs would double the time
        splits = max(1, min(tiles, (per_sm or dft.per_sm) * _sm_count(device) // blocks))
        span = _cdiv(tiles, splits) * be
    elif span % be or span <= 0:
        raise ValueError(f"span {span} must be a positive multiple of block_e {be}")
    return dict(BLOCK_Q=bq, BLOCK_E=be, span=span, num_warps=num_warps or dft.num_warps,
                num_stages=num_stages or dft.num_stages, maxnreg=maxnreg or dft.maxnreg,
                fp8_mode=Fp8Mode(fp8_mode))  # fmt: skip


def check_operands(q, w, keys, rows: PoolRows, key_scale) -> None:
    """What `indexer.flash_index_logits` takes (its docstring lists the `ValueError` cases)."""
    fp4 = keys.dtype == FP4_DTYPE  # two channels a byte, one scale per 32 channels
    d = q.shape[2] if q.dim() == 3 else -1
    width = d // 2 if fp4 else d
    if d < 0 or w.shape != q.shape[:2] or keys.dim() != 2 or keys.shape[1] != width:
        raise ValueError(f"q {tuple(q.shape)}, w {tuple(w.shape)}, keys {tuple(keys.shape)}")
    if q.dtype not in _PARTS or q.dtype in FP8_DTYPES + (FP4_DTYPE,) or keys.dtype not in _PARTS:
        raise ValueError(
            f"q {q.dtype} / keys {keys.dtype}: the kernel takes fp32/bf16/fp16 q and "
            "fp32/bf16/fp16/float8_e4m3fn/FP4 (uint8) keys (fp64: index_logits_reference)"
        )
    if rows.num_queries != q.shape[0]:
        raise ValueError(f"rows has {rows.num_queries} queries, q {q.shape[0]}")
    if keys.dtype in FP8_DTYPES and (key_scale is None or key_scale.shape != keys.shape[:1]):
        raise ValueError("FP8 keys need key_scale (one fp32 scale per pool row)")
    if fp4 and (d % 32 or key_scale is None or key_scale.shape != (keys.shape[0], d // 32)):
        raise ValueError("FP4 keys need d % 32 == 0 and key_scale (S, d // 32): one per 32")
    if keys.stride(1) != 1:
        raise ValueError("keys must be contiguous along d (the pool is read in place)")
