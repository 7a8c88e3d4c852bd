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
# GGUF kinds an int4 / int8 expert buffer keeps as they are, gate, up and down all of one kind
# (online/experts/packing.py packs them; placement.settings' ``experts`` role names their tier format)
EXPERT_FILE_BLOCKS = {"int4": ("Q4_0", "Q4_1"), "int8": ("Q8_0",)}


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


def expert_file_blocks(fmt: str, role_format: str | None) -> str | None:
    """The tier format of the file's blocks an expert in ``fmt`` keeps, given the plan's ``experts`` role format
    for its layer (None where the role names none, or a kind ``fmt`` does not keep).

    >>> expert_file_blocks("int4", "q4_1"), expert_file_blocks("int8", "q4"), expert_file_blocks("int8", "q8")
    ('q4_1', None, 'q8')
    """
    kept = {_RAW_AS_IS[kind][0] for kind in EXPERT_FILE_BLOCKS.get(fmt, ())}
    return role_format if role_format in kept else None


def expert_layout_bytes(hidden_size: int, n_ff: int, gated: bool, fmt: str, bias: bool = False,
                        align_bytes: int = 64, group_size: int = 32, file_blocks: str | None = None) -> int:
    """Bytes of one packed expert buffer, from shapes alone (mirrors ``online.experts.packing.pack_expert``).
    ``file_blocks``: the tier format ("q4", "q4_1", "q8") of a GGUF file's blocks the expert keeps at the file's
    bytes (f16 scales); else quantized: int4 codes with float32 scales and minimums, int8 rows with a float32
    scale each, the down projection [d, n_ff] whole where 32-wide blocks divide n_ff (else int8 rows of the
    transposed down).

    >>> expert_layout_bytes(64, 64, True, "int4"), expert_layout_bytes(64, 64, True, "int4", file_blocks="q4")
    (9216, 6912)
    """
    def aligned(n: int) -> int:
        return (n + align_bytes - 1) // align_bytes * align_bytes
    n_mats, weights, groups = (3 if gated else 2), n_ff * hidden_size, n_ff * hidden_size // group_size
    if fmt == "fp32":
        fields = [4 * weights] * n_mats
    elif file_blocks is not None:  # codes and f16 scales per 32 weights (Q4_1: f16 minimums too), every matrix
        codes = weights if file_blocks == "q8" else weights // 2
        fields = ([codes, 2 * groups] + ([2 * groups] if file_blocks == "q4_1" else [])) * n_mats
    else:
        rows = [weights, 4 * n_ff] if fmt == "int8" else [weights // 2, 4 * groups, 4 * groups]  # gate / up
        if n_ff % group_size == 0:  # the down whole: int8 rows (d of them) or int4 groups
            down = [weights, 4 * hidden_size] if fmt == "int8" else [weights // 2, 4 * groups, 4 * groups]
        else:  # the down transposed in int8 rows
            down = [weights, 4 * n_ff]
        fields = rows * (n_mats - 1) + down
    if bias:
        fields += [4 * n_ff] * (n_mats - 1) + [4 * hidden_size]
    return sum(aligned(n) for n in fields)
