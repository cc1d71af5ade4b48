"""Token ids no loader checks: ``generation_config.json`` (a file transformers reads silently,
falling back to config.json when it does not parse) and the added tokens of the tokenizer files
(``tokenizer_config.json``'s ``added_tokens_decoder``, ``added_tokens.json``) against the
vocabulary the model's embedding has (config.json's ``vocab_size``). An id at or past it is
accepted by every loader and fails only when generation reaches it (an index error in the
embedding, or a stop or pad token the model can never produce)."""

from __future__ import annotations

from typing import Any

from ckptctl.config_fields import ConfigFields, as_int
from ckptctl.findings import ERROR
from ckptctl.format import names as N
from ckptctl.format import small
from ckptctl.verify.context import MAX_JSON_BYTES, Context

GENERATION_CONFIG = "generation_config.json"
# generation_config.json fields that hold token ids (one id, a list of ids, or lists of them) that
# generation indexes the logits or the embedding with. Not suppress_tokens nor begin_suppress_tokens:
# their logits processors mask the vocabulary by membership (torch.isin), so an id past it is
# harmless (a Whisper generation config may list ids of a larger vocabulary).
ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id", "forced_bos_token_id",
             "forced_eos_token_id", "no_timestamps_token_id", "bad_words_ids")
_FIX_GEN = "fix the ids in generation_config.json (or resize the embeddings and re-export the model)"


def quiet_json(ctx: Context, name: str) -> tuple[bool, Any]:
    """(True, document) of a JSON file of the directory, (False, None) when it is absent, screened
    out or unreadable. Nothing is reported: the step that owns the file reports it."""
    if name not in ctx.names or name in ctx.hidden:
        return False, None
    try:
        return True, small.loads(small.read_small(ctx.root / name, limit=MAX_JSON_BYTES, follow=True).decode("utf-8"))
    except (OSError, ValueError):
        return False, None


def vocab_size(ctx: Context) -> int | None:
    """config.json's ``vocab_size`` (its text config's, for a multimodal model), or None."""
    ok, cfg = quiet_json(ctx, N.CONFIG)
    if not ok or not isinstance(cfg, dict):
        return None
    v = as_int(ConfigFields(cfg).get("vocab_size"))
    return v if v is not None and v > 0 else None


def _ids(value: Any) -> list[int]:
    """Every integer inside an id field (an int, a list, a list of lists)."""
    if as_int(value) is not None:
        return [value]
    if isinstance(value, list):
        return [i for v in value[:100_000] for i in _ids(v)]
    return []


def generation_config(ctx: Context, vocab: int | None) -> None:
    """``config.generation_config_bad``: generation_config.json does not parse (transformers'
    ``from_pretrained`` catches the OSError and builds a generation config from config.json: the
    model's sampling settings, stop and pad ids are silently gone); ``config.generation_token_id``:
    a token id at or past the vocabulary."""
    if GENERATION_CONFIG not in ctx.names or GENERATION_CONFIG in ctx.hidden:
        return
    shown = ctx.disp(GENERATION_CONFIG)
    ctx.record(GENERATION_CONFIG, "config")
    try:
        raw = small.read_small(ctx.root / GENERATION_CONFIG, limit=MAX_JSON_BYTES, follow=True)
        doc = small.loads(raw.decode("utf-8"))
    except OSError as exc:
        ctx.io(GENERATION_CONFIG, exc)
        return
    except ValueError as exc:  # bad UTF-8, bad JSON, nested too deeply
        doc, why = None, type(exc).__name__
    else:
        why = None if isinstance(doc, dict) else f"a JSON {type(doc).__name__}, not an object"
    if why is not None:
        ctx.add("config.generation_config_bad", ERROR, shown,
                f"{shown} is not a valid generation config ({why}): transformers silently falls back to a "
                "generation config made from config.json, dropping the model's generation settings",
                "fix the file, or write it again with model.generation_config.save_pretrained(DIR)")
        return
    if vocab is None:
        return
    for field in ID_FIELDS:
        bad = sorted({i for i in _ids(doc.get(field)) if i >= vocab})
        if bad:
            ctx.add("config.generation_token_id", ERROR, shown,
                    f"{shown}: {field} holds token id {bad[0]}{' ...' if len(bad) > 1 else ''}, outside the "
                    f"vocabulary of {vocab} (config.json vocab_size): transformers loads it, and generation "
                    "fails or never stops when it meets the id", _FIX_GEN, field=field, ids=bad[:20],
                    vocab_size=vocab)


def tokenizer_added(ctx: Context, vocab: int | None) -> None:
    """``config.tokenizer_added_id``: an added or special token whose id is at or past the
    vocabulary, in ``tokenizer_config.json`` (``added_tokens_decoder``: id -> token) or
    ``added_tokens.json`` (token -> id). The tokenizer loads and emits the id; the embedding
    lookup of it fails at run time."""
    if vocab is None:
        return
    found: list[tuple[str, str, int]] = []
    ok, doc = quiet_json(ctx, "tokenizer_config.json")
    if ok and isinstance(doc, dict) and isinstance(doc.get("added_tokens_decoder"), dict):
        for key, tok in doc["added_tokens_decoder"].items():
            if isinstance(key, str) and key.isdigit() and int(key) >= vocab:
                content = tok.get("content") if isinstance(tok, dict) else None
                found.append(("tokenizer_config.json", str(content), int(key)))
    ok, doc = quiet_json(ctx, "added_tokens.json")
    if ok and isinstance(doc, dict):
        found += [("added_tokens.json", str(t), i) for t, i in doc.items() if as_int(i) is not None and i >= vocab]
    for name in sorted({f for f, _, _ in found}):
        mine = sorted((i, t) for f, t, i in found if f == name)
        ctx.add("config.tokenizer_added_id", ERROR, ctx.disp(name),
                f"{ctx.disp(name)}: added token {mine[0][1]!r} has id {mine[0][0]}"
                + (f" (and {len(mine) - 1} more)" if len(mine) > 1 else "")
                + f", outside the vocabulary of {vocab} (config.json vocab_size): the tokenizer emits it and the "
                "embedding lookup fails at run time",
                "resize the embeddings (model.resize_token_embeddings(len(tokenizer))) and re-export, or remove the "
                "token", ids=[i for i, _ in mine[:20]], vocab_size=vocab)
