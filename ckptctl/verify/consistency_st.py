"""The dimensions a sentence-transformers root's modules pass along (``modules.json`` in order):
the Transformer's hidden size into Pooling's ``embedding_dimension``, Pooling's output (that
dimension times its pooling modes) into a Dense's ``in_features``, a Dense's ``out_features``
into the next; and each Dense's weights against its config. sentence-transformers loads every
module from its own config without comparing them: a Pooling dimension that disagrees loads and
encodes, and ``get_sentence_embedding_dimension()`` reports the wrong size (what vector stores
are configured with); a Dense that disagrees fails only at ``encode``."""

from __future__ import annotations

from typing import Any

from ckptctl.config_fields import ConfigFields, as_int
from ckptctl.findings import ERROR
from ckptctl.format import names as N
from ckptctl.format import small
from ckptctl.layout.model import MODULES_JSON, SENTENCE_TRANSFORMERS
from ckptctl.verify.context import MAX_JSON_BYTES, Context

_OLD_MODES = ("pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_max_tokens",
              "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken")
_HINT = ("make the module configs agree (each module's config.json), or save the model again with "
         "SentenceTransformer.save")


def _json(ctx: Context, rel: str) -> Any:
    target = ctx.inside(rel)
    if target is None:
        return None
    try:
        return small.loads(small.read_small(target, limit=MAX_JSON_BYTES, follow=True).decode("utf-8"))
    except (OSError, ValueError):
        return None  # a missing or unreadable module config is the module's own problem


def _in(path: str, name: str) -> str:
    return f"{path}/{name}" if path else name


def _pooling_out(cfg: dict[str, Any], dim: int) -> int | None:
    mode = cfg.get("pooling_mode")
    if isinstance(mode, str):
        return dim
    if isinstance(mode, list) and mode:
        return dim * len(mode)
    count = sum(1 for k in _OLD_MODES if cfg.get(k) is True)
    return dim * count if count else None


def st_dimensions(ctx: Context) -> None:
    """``config.st_dimension_mismatch``: two modules of a sentence-transformers root disagree on
    the dimension one passes to the next, or a Dense's weights disagree with its config."""
    assert ctx.layout is not None
    if ctx.prefix or ctx.layout.kind != SENTENCE_TRANSFORMERS:
        return
    modules = _json(ctx, MODULES_JSON)
    if not isinstance(modules, list):
        return  # layout.bad_component_manifest
    token_dim: int | None = None
    dim: int | None = None
    for m in modules:
        if not isinstance(m, dict) or not isinstance(m.get("path", ""), str) or not isinstance(m.get("type"), str):
            return
        path, kind = m.get("path", ""), m["type"].rsplit(".", 1)[-1]
        cfg = _json(ctx, _in(path, N.CONFIG))
        shown = ctx.disp(_in(path, N.CONFIG))
        if not isinstance(cfg, dict):
            token_dim = dim = None
            continue
        if kind == "Transformer":
            token_dim, dim = as_int(ConfigFields(cfg).get("hidden_size")), None
        elif kind == "Pooling":
            emb = as_int(cfg.get("embedding_dimension", cfg.get("word_embedding_dimension")))
            if emb is not None and token_dim is not None and emb != token_dim:
                ctx.add("config.st_dimension_mismatch", ERROR, shown,
                        f"{shown}: Pooling's embedding_dimension is {emb}, but the Transformer module before it "
                        f"outputs {token_dim}: sentence-transformers loads it and reports a sentence embedding "
                        "dimension the model does not produce", _HINT, stated=emb, actual=token_dim)
            dim = _pooling_out(cfg, token_dim if token_dim is not None else emb) if (token_dim or emb) else None
        elif kind == "Dense":
            n_in, n_out = as_int(cfg.get("in_features")), as_int(cfg.get("out_features"))
            if n_in is not None and dim is not None and n_in != dim:
                ctx.add("config.st_dimension_mismatch", ERROR, shown,
                        f"{shown}: Dense's in_features is {n_in}, but the module before it outputs {dim}: encode "
                        "fails with a shape error", _HINT, stated=n_in, actual=dim)
            _dense_weights(ctx, path, shown, n_in, n_out)
            dim = n_out
        elif kind != "Normalize":
            dim = None  # a module whose output dimension is not known here


def _dense_weights(ctx: Context, path: str, shown: str, n_in: int | None, n_out: int | None) -> None:
    rel = _in(path, "model.safetensors")
    target = ctx.inside(rel)
    if target is None or n_in is None or n_out is None or not target.is_file():
        return
    hdr = ctx.reading.header(target, display=ctx.disp(rel))
    w = hdr.tensors.get("linear.weight") if hdr.ok else None
    if w is not None and tuple(w.shape) != (n_out, n_in):
        ctx.add("config.st_dimension_mismatch", ERROR, ctx.disp(rel),
                f"{ctx.disp(rel)}: linear.weight is {list(w.shape)}, but {shown} says {n_in} -> {n_out} "
                f"(a [{n_out}, {n_in}] weight): loading the module fails", _HINT, tensor="linear.weight",
                stated=[n_out, n_in], actual=list(w.shape))
