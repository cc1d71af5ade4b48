"""A GPTQ or AWQ checkpoint whose ``quantization_config`` disagrees with how its tensors are packed
(issue 45): ``bits`` or ``group_size`` edited, or a config copied from another quantization of the
model. transformers builds the quantized layers from the config (GPT-QModel's kernels) and the load
stops at the first packed tensor of another shape (``size mismatch``); verify says which field and
which layer, from config.json and the headers alone.

The packed shapes are GPT-QModel's (``_register_gptq_buffers``, ``AwqGEMMQuantLinear``), with
``P`` the bits of the stored integer (int32: 32) and ``G = ceil(in / group_size)``
(``group_size: -1``: one group):

- GPTQ (``checkpoint_format`` gptq or gptq_v2): ``qweight [ceil(in*bits/P), out]``,
  ``qzeros [G, ceil(out*bits/P)]``, ``scales [G, out]``, ``g_idx [in]``;
- AWQ GEMM (``version`` gemm): ``qweight [in, ceil(out*bits/P)]``, ``qzeros [in // group_size,
  ceil(out*bits/P)]``, ``scales [in // group_size, out]``.

``out`` is read from ``scales``, ``in`` from ``g_idx`` (GPTQ; else from ``qweight`` and ``bits``)
or ``qweight`` (AWQ). A GPTQ layer without ``g_idx`` is ``config.quant_g_idx_missing``: transformers
reports the buffer missing, leaves it uninitialised, and the first forward indexes the scales with
it. Other formats (marlin, bitblas, AWQ GEMV, per-module ``dynamic`` overrides)
are not judged: one note says so.
"""

from __future__ import annotations

from typing import Any

from ckptctl.config_fields import as_int
from ckptctl.findings import ERROR, INFO
from ckptctl.format import names as N
from ckptctl.format.tensor import TensorSpec
from ckptctl.verify.context import Context

# the integer a packed word is stored in, by safetensors dtype
_WORD_BITS = {"I32": 32, "I16": 16, "I8": 8, "I64": 64, "U8": 8}
_HINT = ("set bits and group_size in quantization_config to those the model was quantized with (copy config.json "
         "from the quantized model), or quantize the model again")


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _layout(q: dict[str, Any]) -> str | None:
    """'gptq' or 'awq' (GEMM) when the config names a packing this check knows, else None."""
    method = q.get("quant_method")
    if method == "gptq":
        fmt = q.get("checkpoint_format", q.get("format", "gptq"))
        return "gptq" if fmt in ("gptq", "gptq_v2") else None
    if method == "awq":
        version = q.get("version", q.get("format", "gemm"))
        return "awq" if isinstance(version, str) and version.lower() == "gemm" else None
    return None


def _expected(layout: str, bits: int, group: int, word: int, qweight: tuple[int, ...], scales: tuple[int, ...],
              g_idx: tuple[int, ...] | None) -> dict[str, tuple[int, ...]]:
    """The shapes ``bits`` and ``group`` give for a layer whose out (and in) features are read off
    its tensors (a shape that cannot be judged is given as found)."""
    out = scales[1]
    if layout == "gptq":
        if g_idx is not None and len(g_idx) == 1:
            n_in = g_idx[0]
        elif (qweight[0] * word) % bits == 0:
            n_in = qweight[0] * word // bits
        else:  # in_features is not a multiple of the word: without g_idx only the columns are judged
            return {"qweight": qweight, "qzeros": (scales[0], _ceil(out * bits, word)), "scales": scales}
        groups = 1 if group == -1 else _ceil(n_in, group)
        return {"qweight": (_ceil(n_in * bits, word), out), "qzeros": (groups, _ceil(out * bits, word)),
                "scales": (groups, out)}
    n_in = qweight[0]
    groups = 1 if group == -1 else n_in // group
    return {"qweight": (n_in, _ceil(out * bits, word)), "qzeros": (groups, _ceil(out * bits, word)),
            "scales": (groups, out)}


def _field(name: str, expected: dict[str, tuple[int, ...]], got: tuple[int, ...]) -> str:
    """Which config field a packed tensor's wrong shape points at."""
    if name == "scales" or (name == "qzeros" and got[1] == expected["qzeros"][1]):
        return "group_size"
    return "bits"


def quantized_packing(ctx: Context) -> None:
    """``config.quant_packing_mismatch``, ``config.quant_g_idx_missing`` and
    ``config.quant_packing_not_checked`` (module docstring)."""
    if ctx.prefix or not ctx.tables:
        return
    present, cfg = ctx.open_json(N.CONFIG, "config", "config.bad_json")
    if not present or not isinstance(cfg, dict) or not isinstance(cfg.get("quantization_config"), dict):
        return
    q = cfg["quantization_config"]
    if q.get("quant_method") not in ("gptq", "awq"):
        return
    tensors: dict[str, TensorSpec] = {}
    for table in ctx.tables:
        tensors.update(table.tensors)
    layers = sorted(n[: -len(".qweight")] for n in tensors if n.endswith(".qweight"))
    if not layers:
        return
    layout, bits, group = _layout(q), as_int(q.get("bits")), as_int(q.get("group_size", 128))
    shown = ctx.disp(N.CONFIG)
    if layout is None or q.get("dynamic") or bits is None or not 1 <= bits <= 16 or group is None \
            or not (group == -1 or group > 0):
        ctx.add("config.quant_packing_not_checked", INFO, shown,
                f"{shown}: the packing of this {q.get('quant_method')} checkpoint ({len(layers)} quantized layers) is "
                "not checked: only GPTQ and AWQ GEMM with one bits and group_size for every layer are", None)
        return
    wrong: list[tuple[str, str, str, tuple[int, ...], tuple[int, ...]]] = []  # layer, field, tensor, got, want
    no_g_idx: list[str] = []
    for layer in layers:
        specs = {k: tensors.get(f"{layer}.{k}") for k in ("qweight", "qzeros", "scales", "g_idx")}
        qw, sc, qz = specs["qweight"], specs["scales"], specs["qzeros"]
        if qw is None or sc is None or qz is None or len(qw.shape) != 2 or len(sc.shape) != 2 \
                or len(qz.shape) != 2 or qw.dtype not in _WORD_BITS:
            continue  # not a layout of these two (a missing tensor is the model check's)
        g_idx = specs["g_idx"].shape if specs["g_idx"] is not None else None
        if layout == "gptq" and g_idx is None:
            no_g_idx.append(layer)
        exp = _expected(layout, bits, group, _WORD_BITS[qw.dtype], qw.shape, sc.shape, g_idx)
        for name, spec in (("qweight", qw), ("qzeros", qz), ("scales", sc)):
            if spec.shape != exp[name]:
                wrong.append((layer, _field(name, exp, spec.shape), name, spec.shape, exp[name]))
                break
    if no_g_idx:
        ctx.add("config.quant_g_idx_missing", ERROR, shown,
                f"{shown}: {len(no_g_idx)} of {len(layers)} GPTQ layers have no g_idx (first: {no_g_idx[0]}.g_idx): "
                "transformers loads the file and leaves g_idx uninitialised, and the first forward indexes the "
                "scales with it (an IndexError, or another model)", "export the checkpoint again from the quantized "
                "model (GPT-QModel writes g_idx for every layer)", layers=len(no_g_idx), tensor=f"{no_g_idx[0]}.g_idx")
    if not wrong:
        return
    layer, _, name, got, want = wrong[0]
    fields = sorted({w[1] for w in wrong})
    ctx.add("config.quant_packing_mismatch", ERROR, shown,
            f"{shown}: quantization_config's {' and '.join(fields)} (bits {bits}, group_size {group}) disagree with "
            f"how {len(wrong)} of {len(layers)} quantized layers are packed: {layer}.{name} is {list(got)}, the config "
            f"makes {list(want)}; transformers stops at load with a size mismatch", _HINT,
            fields=fields, layers=len(wrong), tensor=f"{layer}.{name}", shape=list(got),
            expected=list(want), bits=bits, group_size=group)
