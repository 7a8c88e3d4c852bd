"""Tier formats: bytes per weight as the planner counts them and as the GPU tier stores them.

Formats (``placement.settings.WEIGHT_FORMATS``):

- ``fp32`` (4), ``fp16`` (2): the rows as they are.
- ``q8`` (1.0625): GGUF Q8_0 layout, int8 codes ``[R, C]`` + float16 scale per 32 inputs ``[R, C/32]``.
- ``q4_1`` (0.625): GGUF Q4_1 layout, as ``q4`` plus a float16 block minimum ``[R, C/32]``:
  w = scale * q + minimum (the format of Q4_1 checkpoints, whose blocks re-encode almost exactly).
- ``q4`` (0.5625): GGUF Q4_0 layout, codes 0..15 packed two per byte ``[R, C/2]`` (inside block g,
  byte j holds element 32g + j in its low nibble and 32g + 16 + j in its high nibble, as GGUF and the
  CPU tier's ``Int4Weight`` order them) + float16 scale ``[R, C/32]``; w = scale * (q - 8).

Rows whose width is not a multiple of 32 are zero-padded to one (the padding is charged too). The
runtime's matrices in these formats: ``online.execution.tier_matrix.TierMatrix``.

Example::

    tier_matrix_bytes(1536, 576, "q4")     # 497664: what the planner charges and the tier stores
    tier_format_for(0.6)                   # "q4": the closest format within a bytes-per-weight budget
"""
from __future__ import annotations


TIER_FORMATS = {"fp32": 4.0, "fp16": 2.0, "q8": 1.0625, "q4_1": 0.625, "q4": 0.5625}
BLOCK = 32
# GGUF block types a tier format holds as they are: (format, bytes of the block head: f16 scale (+ minimum))
_RAW_AS_IS = {"Q8_0": ("q8", 2), "Q4_0": ("q4", 2), "Q4_1": ("q4_1", 4), "F32": ("fp32", 0), "F16": ("fp16", 0)}


def format_lookup(pairs, role: str, layer: int | None, default: str) -> str:
    """A tensor's tier format from ``(key, format)`` pairs: ``layers.{layer}.{role}``, else ``role``, else ``default``.

    >>> pairs = (("ffn_up", "q4_1"), ("layers.2.ffn_up", "q8"))
    >>> format_lookup(pairs, "ffn_up", 2, "q4"), format_lookup(pairs, "ffn_up", 0, "q4")
    ('q8', 'q4_1')
    >>> format_lookup((), "output", None, "q4")
    'q4'
    """
    table = dict(pairs)
    if layer is not None and f"layers.{layer}.{role}" in table:
        return table[f"layers.{layer}.{role}"]
    return table.get(role, default)


def tier_matrix_bytes(rows: int, cols: int, fmt: str) -> int:
    """Bytes a ``[rows, cols]`` TierMatrix takes in ``fmt`` (the planner counts these).

    >>> tier_matrix_bytes(1536, 576, "q4_1"), tier_matrix_bytes(2, 40, "q8"), tier_matrix_bytes(2, 40, "fp16")
    (552960, 136, 160)
    """
    if fmt in ("fp32", "fp16"):
        return int(rows * cols * TIER_FORMATS[fmt])
    padded = -(-cols // BLOCK) * BLOCK
    return int(round(rows * padded * TIER_FORMATS[fmt]))


def tier_format_for(bytes_per_weight: float) -> str:
    """The densest tier format that still holds ``bytes_per_weight`` (the plan's) or more bytes of detail.

    >>> tier_format_for(0.5625), tier_format_for(0.625), tier_format_for(2.0), tier_format_for(1.5)
    ('q4', 'q4_1', 'fp16', 'q8')
    """
    fitting = [(bpw, name) for name, bpw in TIER_FORMATS.items() if bpw <= bytes_per_weight + 1e-9]
    if not fitting:
        return "q4"
    return max(fitting)[1]


def expert_format_for(bytes_per_weight: float) -> str:
    """The expert packing (``online.experts.packing``) a plan's bytes per weight runs experts in.

    >>> expert_format_for(4.0), expert_format_for(2.0), expert_format_for(0.5625)
    ('fp32', 'int8', 'int4')
    """
    if bytes_per_weight >= TIER_FORMATS["fp32"]:
        return "fp32"
    return "int8" if bytes_per_weight >= TIER_FORMATS["q8"] else "int4"


def expert_layout_bytes(hidden_size: int, n_ff: int, gated: bool, fmt: str, bias: bool = False,
                        align_bytes: int = 64, group_size: int = 32, file_blocks: bool = False) -> int:
    """Bytes of one packed expert buffer, from shapes alone (mirrors ``online.experts.packing.pack_expert``);
    ``file_blocks``: an expert kept in a GGUF file's blocks (int4: Q4_0 / Q4_1, int8: Q8_0; the down [d, n_ff] too).

    >>> expert_layout_bytes(64, 48, True, "int4"), expert_layout_bytes(64, 48, True, "int4", file_blocks=True)
    (7872, 6656)
    """
    def aligned(n: int) -> int:
        return (n + align_bytes - 1) // align_bytes * align_bytes
    n_mats = 3 if gated else 2
    if fmt == "fp32":
        fields = [4 * n_ff * hidden_size] * n_mats
    else:
        if fmt == "int8" and file_blocks:  # Q8_0: codes, a float32 scale per 32 inputs; the down alike
            first = [n_ff * hidden_size, 4 * n_ff * (hidden_size // 32)]
        elif fmt == "int8":
            first = [n_ff * hidden_size, 4 * n_ff]  # codes, per-row scale
        else:
            groups = n_ff * (hidden_size // group_size)
            first = [n_ff * hidden_size // 2, 4 * groups, 4 * groups]  # nibbles, scale, minimum
        if file_blocks:  # the down as the file stores it: [d, n_ff], blocks along n_ff
            groups_down = hidden_size * (n_ff // group_size)
            down = ([n_ff * hidden_size // 2, 4 * groups_down, 4 * groups_down] if fmt == "int4"
                    else [n_ff * hidden_size, 4 * groups_down])
            fields = first * (n_mats - 1) + down
        else:
            fields = first * (n_mats - 1) + [n_ff * hidden_size, 4 * n_ff]  # down_t as int8 rows
    if bias:
        fields += [4 * n_ff] * (n_mats - 1) + [4 * hidden_size]
    return sum(aligned(n) for n in fields)
