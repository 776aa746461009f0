"""The packed matmul and the greedy screens (native/gemm.cpp, int8_head_screen.cpp,
native/greedy_screen.cpp) for torch tensors: checks (the torch extension's
RuntimeError messages), output allocation, pointers to the library."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from aioserve.cpu.native_lib import code, library

logger = logging.getLogger(__name__)


def gemm_block_width() -> int:
    """Output columns per packed weight block."""
    return library().block_width


def gemm_fuses_multiply_add() -> bool:
    """Whether each output is a chain of fused multiply-adds (what screened_argmax recomputes)."""
    return library().fuses_multiply_add


def packs_bf16_pairs() -> bool:
    """Whether bf16 weights are packed in k-pairs (AVX512-BF16)."""
    return library().packs_bf16_pairs


def use_matrix_tiles(want: bool) -> bool:
    """Let bf16 x pair-packed bf16 products run on AMX tiles (the default
    where the CPU has them; AIOSERVE_AMX=0 turns them off at load) or keep
    them on the AVX512-BF16 pair dots. Process-wide; returns whether the
    tiles are in use (built for this CPU, permitted by the OS, wanted)."""
    return library().use_tiles(want)


def matrix_tiles_in_use() -> bool:
    """Whether bf16 products run on AMX tiles now (see use_matrix_tiles)."""
    return library().tiles_in_use()


def packed_fields(weight: torch.Tensor, k: int, n: int, what: str) -> tuple[int, int, int]:
    """(pointer, dtype code, pairs) of a weight packed by pack_linear_weight
    for x [M, k] -> [M, n]; the checks packed_linear makes at each call."""
    block = gemm_block_width()
    pairs = weight.dim() == 4
    if not ((weight.dim() == 3 or (pairs and packs_bf16_pairs() and weight.shape[3] == 2
                                   and weight.dtype == torch.bfloat16))
            and weight.shape[2] == block and weight.is_contiguous()):
        raise RuntimeError(f"packed_linear: the weight must come from pack_linear_weight ({what})")
    packed_k = 2 * weight.shape[1] if pairs else weight.shape[1]
    if packed_k != k:
        raise RuntimeError(f"packed_linear: x has {k} features, the weight {packed_k} ({what})")
    if not (0 < n <= weight.shape[0] * block and n > (weight.shape[0] - 1) * block):
        raise RuntimeError(f"packed_linear: bad N ({what})")
    return weight.data_ptr(), code(weight, "packed_linear"), int(pairs)


def lora_part_blocks(b: torch.Tensor, columns: tuple[int, ...]) -> torch.Tensor:
    """A slot's B [band, out] as the library reads it: each part's block
    (its band / parts rank rows by its own output columns) flattened, one
    after the other, [band / parts * out]. A fused projection's B is
    block-diagonal: the zeros between the blocks are left out."""
    parts = len(columns) - 1
    rank = b.shape[0] // parts
    return torch.cat([b[p * rank : (p + 1) * rank, start:end].reshape(-1)
                      for p, (start, end) in enumerate(zip(columns, columns[1:]))])


@dataclass
class LoraPointers:
    """A projection's LoRA slots for the library (kernels.h's LoraSlots):
    each slot's A [band, in] as it is and its B as `lora_part_blocks` lays
    it out, contiguous, of one dtype each (native/lora.cpp multiplies by A
    in dot products, x [M, in] -> [M, band], then by each part's block of
    B). Checked once. The tensors must stay where they are (a slot is
    rewritten in place)."""

    a: list[torch.Tensor]
    b: list[torch.Tensor]
    band: int
    in_features: int
    out_features: int
    columns: tuple[int, ...] = ()  # each part's first output column, then out_features; () for one part

    def __post_init__(self) -> None:
        columns = self.columns or (0, self.out_features)
        parts = len(columns) - 1
        if (columns[0] != 0 or columns[-1] != self.out_features or any(a >= b for a, b in zip(columns, columns[1:]))
                or self.band % parts or len(self.b) != len(self.a)):
            raise RuntimeError("lora: the parts' columns, band and B slots do not fit together")
        if any(w.shape != (self.band, self.in_features) or not w.is_contiguous() for w in self.a):
            raise RuntimeError("lora: each slot's A must be [band, in], contiguous")
        if any(w.shape != (self.band // parts * self.out_features,) or not w.is_contiguous() for w in self.b):
            raise RuntimeError("lora: each slot's B must be its parts' blocks (lora_part_blocks), contiguous")
        if len({w.dtype for w in self.a}) != 1 or len({w.dtype for w in self.b}) != 1:
            raise RuntimeError("lora: a projection's slots differ in dtype")
        self.a_ptrs = torch.tensor([w.data_ptr() for w in self.a], dtype=torch.int64)
        self.b_ptrs = torch.tensor([w.data_ptr() for w in self.b], dtype=torch.int64)
        self.column_starts = torch.tensor(columns, dtype=torch.int64)
        # (a, a_type, b, b_type, slots, band, parts, columns): the library's argument order
        self.fields = (self.a_ptrs.data_ptr(), code(self.a[0], "lora A"), self.b_ptrs.data_ptr(),
                       code(self.b[0], "lora B"), len(self.a), self.band, parts, self.column_starts.data_ptr())


def lora_add_rows(x: torch.Tensor, y: torch.Tensor, row_slots: torch.Tensor, slots: LoraPointers) -> None:
    """y [T, out] += each row's (x A_s^T) B_s, s = row_slots[row] (0: none),
    in place; x [T, in] and y contiguous, of one dtype."""
    if (x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0] or x.shape[1] != slots.in_features
            or y.shape[1] != slots.out_features or x.dtype != y.dtype):
        raise RuntimeError("lora_add_rows: x [T, in] and y [T, out] of one dtype")
    if not y.is_contiguous():
        raise RuntimeError("lora_add_rows: y must be contiguous")
    if row_slots.dtype != torch.int64 or row_slots.numel() != x.shape[0]:
        raise RuntimeError("lora_add_rows: row_slots [T] int64")
    lib = library()
    x, row_slots = x.contiguous(), row_slots.contiguous()
    if lib.lora_add_rows(x.data_ptr(), code(x, "lora_add_rows"), x.shape[0], x.shape[1], row_slots.data_ptr(),
                         *slots.fields, y.data_ptr(), y.shape[1]):
        raise lib.fail()


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """Pack W [N, K] for packed_linear: [ceil(N / NB), K, NB], or bf16 k-pairs [.., K / 2, NB, 2]."""
    if weight.dim() != 2:
        raise RuntimeError("pack_linear_weight: W must be [N, K]")
    lib = library()
    n, k = weight.shape
    block = lib.block_width
    blocks = (n + block - 1) // block
    pairs = lib.packs_bf16_pairs and weight.dtype == torch.bfloat16 and k % 2 == 0
    type_code = code(weight, "pack_linear_weight")
    shape = (blocks, k // 2, block, 2) if pairs else (blocks, k, block)
    out = torch.empty(shape, dtype=weight.dtype)
    if lib.pack_linear_weight(weight.data_ptr(), type_code, n, k, weight.stride(0), weight.stride(1), int(pairs),
                              out.data_ptr(), out.nbytes):
        raise lib.fail()
    return out


def float32_bias(bias: torch.Tensor | None, n: int, what: str) -> torch.Tensor | None:
    """A layer's bias as the kernels read it: N contiguous float32 values (None: none)."""
    if bias is None:
        return None
    if bias.numel() != n:
        raise RuntimeError(f"{what}: bias must have N values")
    return bias.to(torch.float32).contiguous()


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int, float_out: bool = False,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b) with a packed W (CPU): [M, n] in x's dtype, or float32
    holding x's dtype's rounding (float_out); into `out` when given."""
    if x.dim() != 2:
        raise RuntimeError("packed_linear: x must be [M, K]")
    lib = library()
    block = lib.block_width
    pairs = packed.dim() == 4
    if not ((packed.dim() == 3 or (pairs and lib.packs_bf16_pairs and packed.shape[3] == 2
                                   and packed.dtype == torch.bfloat16))
            and packed.shape[2] == block and packed.is_contiguous()):
        raise RuntimeError("packed_linear: the weight must come from pack_linear_weight")
    m, k = x.shape
    packed_k = 2 * packed.shape[1] if pairs else packed.shape[1]
    if packed_k != k:
        raise RuntimeError(f"packed_linear: x has {k} features, the weight {packed_k}")
    if not (0 < n <= packed.shape[0] * block and n > (packed.shape[0] - 1) * block):
        raise RuntimeError("packed_linear: bad N")
    x = x.contiguous()
    y_dtype = torch.float32 if float_out else x.dtype
    if out is not None:
        if (out.dim() != 2 or out.shape[0] != m or out.shape[1] != n or not out.is_contiguous()
                or out.dtype != y_dtype or out.device != x.device):
            raise RuntimeError("packed_linear: out must be a contiguous [M, N] tensor of the output's dtype")
        y = out
    else:
        y = torch.empty(m, n, dtype=y_dtype)  # positional sizes: ~1 us less than a tuple
    bias32 = float32_bias(bias, n, "packed_linear")
    if m == 0:
        return y
    if lib.packed_linear(x.data_ptr(), code(x, "packed_linear"), m, k, packed.data_ptr(), code(packed, "packed_linear"),
                         int(pairs), n, bias32.data_ptr() if bias32 is not None else 0, y.data_ptr(), int(float_out)):
        raise lib.fail()
    return y


def packed_linear_argmax(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                         n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(max, first argmax) of each row of packed_linear(x, packed, bias, n,
    float_out=True), a NaN counting as the max, without those [M, n] logits
    (greedy decoding's LM head): row_max_argmax's answer, bit for bit."""
    if x.dim() != 2:
        raise RuntimeError("packed_linear_argmax: x must be [M, K]")
    m, k = x.shape
    pointer, type_code, pairs = packed_fields(packed, k, n, "packed_linear_argmax")
    x = x.contiguous()
    bias32 = float32_bias(bias, n, "packed_linear_argmax")
    maxes = torch.empty(m, dtype=torch.float32)
    argmaxes = torch.empty(m, dtype=torch.int64)
    if m == 0:
        return maxes, argmaxes
    lib = library()
    if lib.packed_linear_argmax(x.data_ptr(), code(x, "packed_linear_argmax"), m, k, pointer, type_code, pairs, n,
                                bias32.data_ptr() if bias32 is not None else 0, maxes.data_ptr(), argmaxes.data_ptr()):
        raise lib.fail()
    return maxes, argmaxes


def screened_argmax(x: torch.Tensor, screen: torch.Tensor, slack: torch.Tensor, exact: torch.Tensor, n: int,
                    screen_norms: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy argmax of x W^T from a half-width copy of W, exactly (see
    native/greedy_screen.cpp): (tokens [M] int64, ok [M] bool)."""
    lib = library()
    if not lib.fuses_multiply_add:
        raise RuntimeError("screened_argmax: packed_linear's sums are not fused here")
    if x.dim() != 2 or x.dtype != torch.float32:
        raise RuntimeError("screened_argmax: x must be float32 [M, K]")
    if exact.dim() != 3 or exact.dtype != torch.float32 or not exact.is_contiguous():
        raise RuntimeError("screened_argmax: the exact weight must be float32, packed by pack_linear_weight")
    bf16 = screen.dim() == 4
    if bf16:
        fits = (screen.dtype == torch.bfloat16 and 2 * screen.shape[1] == exact.shape[1]
                and screen.shape[0] == exact.shape[0] and screen.shape[2] == exact.shape[2])
    else:
        fits = screen.dim() == 3 and screen.shape == exact.shape
    if not fits:
        raise RuntimeError("screened_argmax: the screen must be packed like W (float16), or in bf16 k-pairs")
    if slack.dim() != 1 or slack.numel() != n or slack.dtype != torch.float32:
        raise RuntimeError("screened_argmax: slack must be float32 [N]")
    if bf16 != (screen_norms is not None):
        raise RuntimeError("screened_argmax: a bf16 screen, and only one, comes with screen_norms")
    norms_ptr = 0  # a null pointer
    if screen_norms is not None:
        screen_norms = screen_norms.contiguous()
        if screen_norms.dim() != 1 or screen_norms.numel() != n or screen_norms.dtype != torch.float32:
            raise RuntimeError("screened_argmax: screen_norms must be float32 [N]")
        norms_ptr = screen_norms.data_ptr()
    # What the screen's matmul (packed_linear, or its unrounded bf16 twin) checked.
    matmul = "packed_linear_unrounded" if bf16 else "packed_linear"
    block = lib.block_width
    if not screen.is_contiguous() or screen.shape[2] != block:
        raise RuntimeError(f"{matmul}: the weight must come from pack_linear_weight")
    if not (0 < n <= screen.shape[0] * block and n > (screen.shape[0] - 1) * block):
        raise RuntimeError(f"{matmul}: bad N")
    x = x.contiguous()
    slack = slack.contiguous()
    m, k = x.shape
    if exact.shape[1] != k:
        raise RuntimeError(f"screened_argmax: x has {k} features, the weight {exact.shape[1]}")
    tokens = torch.zeros(m, dtype=torch.int64)
    ok = torch.zeros(m, dtype=torch.bool)
    if lib.screened_argmax(x.data_ptr(), m, k, screen.data_ptr(), code(screen, "screened_argmax"), int(bf16),
                           slack.data_ptr(), exact.data_ptr(), n, exact.shape[2], norms_ptr, tokens.data_ptr(),
                           ok.data_ptr()):
        raise lib.fail()
    return tokens, ok


INT8_SCREEN_MAX_ROWS = 16  # native/int8_head_screen.cpp: two A tiles of two digit rows each
INT8_VNNI_MAX_ROWS = 4  # its VNNI form: the sums of 4 rows' 8 digit rows in registers


def int8_screen_rows() -> int:
    """The most rows int8_screened_argmax takes now: on the AMX-INT8 tiles
    where the bf16 products run on the tiles, else on AVX512-VNNI (the
    blocks it keeps are computed again by whichever the bf16 head uses); 0
    where the library has neither."""
    lib = library()
    if lib.int8_head_screen_forms & 1 and lib.tiles_in_use():
        return INT8_SCREEN_MAX_ROWS
    return INT8_VNNI_MAX_ROWS if lib.int8_head_screen_forms & 2 else 0


def int8_screen_ready() -> bool:
    """Whether int8_screened_argmax runs here (int8_screen_rows)."""
    return int8_screen_rows() > 0


@dataclass
class Int8HeadCopy:
    """An int8 copy of a bf16 LM head and its bound's per-column constants
    (native/int8_head_screen.cpp)."""

    screen: torch.Tensor  # int8 [blocks, K / 4, 32, 4]
    scales: torch.Tensor  # [N] float32 s_j: w~_j = s_j q_j
    slack: torch.Tensor  # [N] float32 ||w_j - w~_j|| + gamma' ||w_j||, rounded up
    norms: torch.Tensor  # [N] float32 ||w~_j||, rounded up
    column_sums: torch.Tensor  # [blocks * 32] int32, each column's sum of q (0 past N): the VNNI form's


def int8_quantize_head(exact: torch.Tensor, n: int) -> Int8HeadCopy | None:
    """The int8 copy of the bf16 head `exact` (packed in k-pairs [blocks,
    K / 2, 32, 2], N columns); None if a weight is not finite."""
    if exact.dtype != torch.bfloat16 or exact.dim() != 4 or exact.shape[2:] != (32, 2) or not exact.is_contiguous():
        raise RuntimeError("int8_quantize_head: the head must be bf16 packed in k-pairs, 32 columns a block")
    blocks, k = exact.shape[0], 2 * exact.shape[1]
    if k % 64 or not (blocks - 1) * 32 < n <= blocks * 32:
        raise RuntimeError("int8_quantize_head: K must be a multiple of 64, N within the packed blocks")
    scales, slack, norms = (torch.empty(n, dtype=torch.float32) for _ in range(3))
    copy = Int8HeadCopy(torch.empty(blocks, k // 4, 32, 4, dtype=torch.int8), scales, slack, norms,
                        torch.zeros(blocks * 32, dtype=torch.int32))
    finite = torch.zeros(1, dtype=torch.bool)
    lib = library()
    if lib.int8_quantize_head(exact.data_ptr(), n, k, copy.screen.data_ptr(), copy.scales.data_ptr(),
                              copy.slack.data_ptr(), copy.norms.data_ptr(), copy.column_sums.data_ptr(),
                              finite.data_ptr()):
        raise lib.fail()
    return copy if bool(finite) else None


def int8_screened_argmax(x: torch.Tensor, copy: Int8HeadCopy, exact: torch.Tensor, n: int,
                         max_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy argmax of the bf16 head `exact` (packed in k-pairs) from its
    int8 copy, exactly: packed_linear_argmax's tokens
    (native/int8_head_screen.cpp). (tokens [M] int64, ok [M] bool); a row
    with ok false (not finite, or more than `max_blocks` blocks to compute
    again) is left to the caller."""
    limit = int8_screen_rows()
    if x.dim() != 2 or x.dtype != torch.bfloat16 or not 1 <= x.shape[0] <= limit:
        raise RuntimeError(f"int8_screened_argmax: x must be bf16 [M, K], 1 <= M <= {limit}")
    m, k = x.shape
    pointer, _, pairs = packed_fields(exact, k, n, "int8_screened_argmax")
    block = gemm_block_width()
    if not pairs or block != 32:
        raise RuntimeError("int8_screened_argmax: the head must be bf16 packed in k-pairs, 32 columns a block")
    screen = copy.screen
    if (screen.dtype != torch.int8 or not screen.is_contiguous()
            or tuple(screen.shape) != (exact.shape[0], k // 4, block, 4) or k % 64):
        raise RuntimeError("int8_screened_argmax: the screen must be int8 [blocks, K / 4, 32, 4], K a multiple of 64")
    for name, column in (("scales", copy.scales), ("slack", copy.slack), ("norms", copy.norms)):
        if column.dtype != torch.float32 or column.shape != (n,) or not column.is_contiguous():
            raise RuntimeError(f"int8_screened_argmax: {name} must be float32 [N]")
    sums = copy.column_sums
    if sums.dtype != torch.int32 or sums.shape != (exact.shape[0] * block,) or not sums.is_contiguous():
        raise RuntimeError("int8_screened_argmax: column_sums must be int32 [blocks * 32]")
    x = x.contiguous()
    tokens = torch.zeros(m, dtype=torch.int64)
    ok = torch.zeros(m, dtype=torch.bool)
    lib = library()
    if lib.int8_screened_argmax(x.data_ptr(), m, k, screen.data_ptr(), copy.scales.data_ptr(), copy.slack.data_ptr(),
                                copy.norms.data_ptr(), sums.data_ptr(), pointer, n, max_blocks, tokens.data_ptr(),
                                ok.data_ptr()):
        raise lib.fail()
    return tokens, ok
