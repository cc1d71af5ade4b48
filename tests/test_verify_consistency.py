"""Issue 30, items 4 and 5: what no loader reports, and two layouts the Hub serves that are clean.

Every checkpoint is written by the real library (transformers, sentence-transformers, torch's DCP,
safetensors); each breakage is judged by the library's own loader too, so verify is shown to be at
least as strict as it. Models are tiny and built once per module."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support import invoke, load_glob, same

VOCAB = 32


def verify(d: Path, *args: object) -> tuple[int, dict[str, str]]:
    r = invoke("verify", d, "--json", *args)
    doc = json.loads(r.stdout)
    return r.exit_code, {f["code"]: f["severity"] for res in doc["results"] for f in res["findings"]}


def not_clean(found: dict[str, str]) -> list[str]:
    return [c for c, s in found.items() if s != "info"]


def llama_config(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32, bos_token_id=1,
                       eos_token_id=2, **kw)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("llama") / "m"
    LlamaForCausalLM(llama_config()).save_pretrained(d)
    return d


def copy(src: Path, tmp_path: Path, name: str = "c") -> Path:
    return Path(shutil.copytree(src, tmp_path / name))


# --------------------------------------------------------------------------------------------
# item 5: Mistral's native files beside the HF shards


def _native(sd: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """Mistral's own names (mistral-inference), q/k in its rotary order."""
    def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
        return w.view(heads, w.shape[0] // heads // 2, 2, w.shape[1]).transpose(1, 2).reshape(w.shape)

    out = {"tok_embeddings.weight": sd["model.embed_tokens.weight"], "norm.weight": sd["model.norm.weight"],
           "output.weight": sd["lm_head.weight"]}
    for i in range(layers):
        p = f"model.layers.{i}."
        out.update({f"layers.{i}.attention.wq.weight": unpermute(sd[p + "self_attn.q_proj.weight"], 4),
                    f"layers.{i}.attention.wk.weight": unpermute(sd[p + "self_attn.k_proj.weight"], 2),
                    f"layers.{i}.attention.wv.weight": sd[p + "self_attn.v_proj.weight"],
                    f"layers.{i}.attention.wo.weight": sd[p + "self_attn.o_proj.weight"],
                    f"layers.{i}.feed_forward.w1.weight": sd[p + "mlp.gate_proj.weight"],
                    f"layers.{i}.feed_forward.w2.weight": sd[p + "mlp.down_proj.weight"],
                    f"layers.{i}.feed_forward.w3.weight": sd[p + "mlp.up_proj.weight"],
                    f"layers.{i}.attention_norm.weight": sd[p + "input_layernorm.weight"],
                    f"layers.{i}.ffn_norm.weight": sd[p + "post_attention_layernorm.weight"]})
    return {k: v.contiguous() for k, v in out.items()}


@pytest.fixture(scope="module")
def mistral(tmp_path_factory) -> Path:
    """As Mistral's repositories ship: transformers' shards + index, and consolidated.safetensors
    with params.json for mistral-inference."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("mistral") / "m"
    model = MistralForCausalLM(MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             head_dim=8, max_position_embeddings=64))
    model.save_pretrained(d, max_shard_size="20KB")
    save_file(_native(model.state_dict(), 2), str(d / "consolidated.safetensors"), metadata={"format": "pt"})
    (d / "params.json").write_text(json.dumps({"dim": 32, "n_layers": 2, "head_dim": 8, "hidden_dim": 64,
                                               "n_heads": 4, "n_kv_heads": 2, "norm_eps": 1e-5,
                                               "vocab_size": VOCAB, "rope_theta": 10000.0}))
    return d


def test_mistral_native_files_beside_hf_shards_are_clean(mistral: Path, tmp_path: Path) -> None:
    from transformers import MistralForCausalLM

    assert len(list(mistral.glob("model-*-of-*.safetensors"))) > 1
    rc, found = verify(mistral, "--deep")
    assert rc == 0 and found.get("layout.native_weights") == "info" and not not_clean(found), found
    model = MistralForCausalLM.from_pretrained(mistral)  # the loader reads the index's files only
    assert same(model.state_dict(), load_glob_of(mistral))
    r = invoke("export", mistral, tmp_path / "out")
    assert r.exit_code == 0, r.stderr
    assert same(load_glob(tmp_path / "out"), load_glob_of(mistral))
    c = copy(mistral, tmp_path)
    before = sorted((p.name, p.stat().st_ino) for p in c.iterdir())
    r = invoke("resave", "--repair", c)
    assert r.exit_code == 0 and "nothing to repair" in r.stdout, r.stderr
    assert sorted((p.name, p.stat().st_ino) for p in c.iterdir()) == before
    raw = bytearray((c / "consolidated.safetensors").read_bytes())  # the native file's header is still checked
    raw[8:10] = b"[["
    (c / "consolidated.safetensors").write_bytes(bytes(raw))
    rc, found = verify(c)
    assert rc == 1 and any(k.startswith("header.") and v == "error" for k, v in found.items()), found


def load_glob_of(d: Path) -> dict[str, torch.Tensor]:
    """The tensors of the HF shards the index names (the native file left out)."""
    index = json.loads((d / "model.safetensors.index.json").read_text())
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        out.update(load_file(str(d / shard)))
    return out


# --------------------------------------------------------------------------------------------
# item 5: pytorch_model.bin beside model.safetensors


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """A transformers 4 pickle (torch.save of the state dict: the tied head one view under two
    names) and the safetensors file transformers writes of the same model, as the conversion
    bot leaves a repository."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("converted") / "m"
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=32,
                                       bos_token_id=0, eos_token_id=0))
    model.save_pretrained(d)
    torch.save(model.state_dict(), d / "pytorch_model.bin")
    return d


def test_bin_beside_safetensors_with_the_same_tensors_is_a_note(converted: Path, tmp_path: Path) -> None:
    from transformers import GPT2LMHeadModel

    for args in ((), ("--deep",)):
        rc, found = verify(converted, *args)
        assert rc == 0 and found.get("layout.converted_pickle") == "info" and not not_clean(found), (args, found)
    r = invoke("export", converted, tmp_path / "out")
    assert r.exit_code == 0, r.stderr
    assert same(load_glob(tmp_path / "out"), load_file(str(converted / "model.safetensors")))
    c = copy(converted, tmp_path)
    before = sorted((p.name, p.stat().st_ino) for p in c.iterdir())
    r = invoke("resave", "--repair", c)
    assert r.exit_code == 0 and "nothing to repair" in r.stdout, r.stderr
    assert sorted((p.name, p.stat().st_ino) for p in c.iterdir()) == before
    # the same names, dtypes and shapes with other bytes: a note statically, an error with --deep,
    # and two models under one name for transformers
    sd = torch.load(c / "pytorch_model.bin", weights_only=True)
    sd["transformer.h.0.mlp.c_fc.weight"] = sd["transformer.h.0.mlp.c_fc.weight"] + 1
    torch.save(sd, c / "pytorch_model.bin")
    rc, found = verify(c)
    assert rc == 0 and "layout.converted_pickle" in found
    rc, found = verify(c, "--deep")
    assert rc == 1 and found.get("deep.pickle_copy_differs") == "error", found
    a = GPT2LMHeadModel.from_pretrained(c).state_dict()["transformer.h.0.mlp.c_fc.weight"]
    b = GPT2LMHeadModel.from_pretrained(c, use_safetensors=False).state_dict()["transformer.h.0.mlp.c_fc.weight"]
    assert not torch.equal(a, b)
    r = invoke("resave", "--repair", "--prefer", "safetensors", c)
    assert r.exit_code == 0 and not (c / "pytorch_model.bin").exists(), r.stderr
    # other shapes: still two models, an error without --deep
    c2 = copy(converted, tmp_path, "c2")
    sd = torch.load(c2 / "pytorch_model.bin", weights_only=True)
    sd["transformer.ln_f.bias"] = torch.zeros(8)
    torch.save(sd, c2 / "pytorch_model.bin")
    rc, found = verify(c2)
    assert rc == 1 and found.get("layout.two_families") == "error", found


# --------------------------------------------------------------------------------------------
# issue 31 and item 4: torch's DCP-HF output


def _dcp_hf_save(d: Path, state: dict[str, torch.Tensor], **kw) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=HuggingFaceStorageWriter(str(d), save_distributed=True, **kw))


def test_dcp_hf_output_is_recognised(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    floats = {"model.embed.weight": torch.randn(10, 6, generator=g), "model.norm.weight": torch.randn(6, generator=g)}
    mapping = {"model.embed.weight": 1, "model.norm.weight": 2}
    root = tmp_path / "consolidated"
    _dcp_hf_save(root, floats, enable_consolidation=True, fqn_to_index_mapping=mapping)
    assert (root / "sharded").is_dir() and list(root.glob("model-*.safetensors"))
    rc, found = verify(root)  # torch's consolidation leaves sharded/ in its output
    assert rc == 0 and found.get("dir.leftover_weights_folder") == "warning", found
    rc, found = verify(root / "sharded")
    assert rc == 0 and found.get("dcp.hf_sharded") == "info" and not not_clean(found), found
    # torch's consolidation fails on an integer tensor: the root holds only sharded/
    failed = tmp_path / "failed"
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException):
        _dcp_hf_save(failed, dict(floats, **{"model.ids": torch.arange(5)}), enable_consolidation=True,
                     fqn_to_index_mapping=dict(mapping, **{"model.ids": 2}))
    rc, found = verify(failed)
    assert rc == 0 and found.get("dcp.hf_sharded") == "info" and not not_clean(found), found
    # a shard file lost: torch's own reader fails, so does verify
    lost = Path(shutil.copytree(failed / "sharded", tmp_path / "lost"))
    (lost / "shard-00001-model-00002-of-00002.safetensors").unlink()
    rc, found = verify(lost)
    assert rc == 1 and found.get("dcp.hf_damaged") == "error", found
    # the consolidated files disagree with sharded/: which one is the checkpoint is not certain
    stale = Path(shutil.copytree(root, tmp_path / "stale"))
    for one in stale.glob("model-*.safetensors"):
        tensors = load_file(str(one))
        if "model.norm.weight" in tensors:
            save_file(dict(tensors, **{"model.norm.weight": torch.ones(7)}), str(one))
    rc, found = verify(stale)
    assert found.get("dir.leftover_weights_folder") == "error", found
    assert invoke("export", stale, tmp_path / "o").exit_code == 2


# --------------------------------------------------------------------------------------------
# item 4: generation_config.json and tokenizer files


def test_generation_config_that_does_not_parse(llama: Path, tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    c = copy(llama, tmp_path)
    gen = json.loads((c / "generation_config.json").read_text())
    gen["eos_token_id"] = 7
    (c / "generation_config.json").write_text(json.dumps(gen)[:-1])  # cut: not JSON any more
    model = LlamaForCausalLM.from_pretrained(c)  # silently built from config.json instead
    assert model.generation_config.eos_token_id == 2
    rc, found = verify(c)
    assert rc == 1 and found.get("config.generation_config_bad") == "error", found


def test_generation_token_ids_outside_the_vocabulary(llama: Path, tmp_path: Path) -> None:
    from transformers import GenerationConfig, LlamaForCausalLM

    rc, found = verify(llama)
    assert rc == 0 and "config.generation_token_id" not in found
    c = copy(llama, tmp_path)
    GenerationConfig(bos_token_id=1, eos_token_id=[2, VOCAB + 3], pad_token_id=VOCAB).save_pretrained(c)
    model = LlamaForCausalLM.from_pretrained(c)  # accepted without a word
    assert model.generation_config.pad_token_id == VOCAB
    with pytest.raises(IndexError):  # padding with it reaches past the embedding
        model(torch.tensor([[1, model.generation_config.pad_token_id]]))
    rc, found = verify(c)
    assert rc == 1 and found.get("config.generation_token_id") == "error", found


def test_added_tokens_outside_the_vocabulary(llama: Path, tmp_path: Path) -> None:
    """A python-backend tokenizer writes its added tokens to tokenizer_config.json
    (added_tokens_decoder) and added_tokens.json; ids past config.json's vocab_size load and fail
    in the embedding."""
    from transformers import AutoTokenizer, LlamaForCausalLM
    from transformers.models.bert.tokenization_bert_legacy import BertTokenizerLegacy

    c = copy(llama, tmp_path)
    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
                                                  + [f"w{i}" for i in range(VOCAB - 7)]) + "\n")
    tok = BertTokenizerLegacy(str(tmp_path / "vocab.txt"))
    tok.add_special_tokens({"additional_special_tokens": ["<a>", "<b>", "<c>", "<d>"]})  # ids 30..33
    tok.save_pretrained(c)
    ids = AutoTokenizer.from_pretrained(c)("w1 <d>")["input_ids"]
    assert max(ids) >= VOCAB
    with pytest.raises(IndexError):
        LlamaForCausalLM.from_pretrained(c)(torch.tensor([ids]))
    rc, found = verify(c)
    assert rc == 1 and found.get("config.tokenizer_added_id") == "error", found


# --------------------------------------------------------------------------------------------
# item 4: a training checkpoint without the model, and ZeRO-3 placeholders


def test_trainer_checkpoint_without_model_weights(llama: Path, tmp_path: Path) -> None:
    """What the Trainer writes beside the model (its optimizer, scheduler and RNG states and
    trainer_state.json), without model.safetensors: an optimizer state is not a model."""
    from transformers import LlamaForCausalLM, TrainerState

    c = tmp_path / "checkpoint-3"
    c.mkdir()
    shutil.copy(llama / "config.json", c)
    model = LlamaForCausalLM.from_pretrained(llama)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    torch.save(opt.state_dict(), c / "optimizer.pt")
    torch.save(sched.state_dict(), c / "scheduler.pt")
    torch.save({"python": 0, "cpu": torch.get_rng_state()}, c / "rng_state.pth")
    TrainerState(global_step=3).save_to_json(str(c / "trainer_state.json"))
    with pytest.raises(OSError):
        LlamaForCausalLM.from_pretrained(c)
    rc, found = verify(c)
    assert rc == 1 and found.get("dir.trainer_state_without_weights") == "error", found
    shutil.copy(llama / "model.safetensors", c)  # with its model it is a checkpoint
    rc, found = verify(c)
    assert rc == 0 and not not_clean(found), found


def test_zero3_placeholders(tmp_path: Path) -> None:
    """ZeRO-3 leaves each parameter a 0-element placeholder on a rank until it is gathered;
    save_pretrained of such a model writes them."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(llama_config())
    for p in model.parameters():
        p.data = torch.empty(0, dtype=p.dtype)  # deepspeed's partitioned parameter
    model.save_pretrained(tmp_path / "c")
    with pytest.raises(RuntimeError):
        LlamaForCausalLM.from_pretrained(tmp_path / "c")
    rc, found = verify(tmp_path / "c")
    assert rc == 1 and found.get("dir.placeholder_tensors") == "error", found


# --------------------------------------------------------------------------------------------
# item 4: sentence-transformers module dimensions


@pytest.fixture(scope="module")
def st_root(tmp_path_factory) -> Path:
    from tests.ecosystem.st_models import make_st

    d = tmp_path_factory.mktemp("st") / "m"
    make_st().save(str(d))
    return d


def test_sentence_transformers_dimensions_that_disagree(st_root: Path, tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    rc, found = verify(st_root)
    assert rc == 0 and not not_clean(found), found
    c = copy(st_root, tmp_path)
    pooling = json.loads((c / "1_Pooling" / "config.json").read_text())
    pooling["embedding_dimension"] = 48
    (c / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    model = SentenceTransformer(str(c), device="cpu", local_files_only=True)  # loads and encodes
    assert model.encode(["w1 w2"]).shape == (1, 16)
    rc, found = verify(c)
    assert rc == 1 and found.get("config.st_dimension_mismatch") == "error", found
    c2 = copy(st_root, tmp_path, "c2")
    dense = json.loads((c2 / "2_Dense" / "config.json").read_text())
    dense["in_features"] = 24
    (c2 / "2_Dense" / "config.json").write_text(json.dumps(dense))
    with pytest.raises(RuntimeError):
        SentenceTransformer(str(c2), device="cpu", local_files_only=True)
    rc, found = verify(c2)
    assert rc == 1 and found.get("config.st_dimension_mismatch") == "error", found


# --------------------------------------------------------------------------------------------
# item 6: the index's total_parameters, counted as transformers counts


def test_sharded_bart_index_total_parameters(tmp_path: Path) -> None:
    """transformers writes num_parameters(): tied parameters once, buffers (BART's
    final_logits_bias) not at all."""
    from transformers import BartConfig, BartForConditionalGeneration

    d = tmp_path / "bart"
    BartForConditionalGeneration(BartConfig(vocab_size=99, d_model=16, encoder_layers=1, decoder_layers=1,
                                            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                            decoder_ffn_dim=32, max_position_embeddings=32)).save_pretrained(
        d, max_shard_size="4KB")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert "final_logits_bias" in index["weight_map"] and index["metadata"]["total_parameters"] > 0
    rc, found = verify(d)
    assert rc == 0 and "index.total_parameters_mismatch" not in found, found
    index["metadata"]["total_parameters"] += 7
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    rc, found = verify(d)
    assert found.get("index.total_parameters_mismatch") == "warning", found


def test_whisper_suppress_tokens_past_a_small_vocabulary_are_not_an_error(tmp_path: Path) -> None:
    """Whisper's generation config lists (begin_)suppress_tokens of the full vocabulary; on a model
    with a smaller one, generate() works (the processors mask the vocabulary by membership), so
    verify reports no error for them."""
    from transformers import GenerationConfig, WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(0)
    cfg = WhisperConfig(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, num_mel_bins=8,
                        max_source_positions=16, max_target_positions=32, pad_token_id=0, bos_token_id=1,
                        eos_token_id=2, decoder_start_token_id=1)
    d = tmp_path / "whisper"
    WhisperForConditionalGeneration(cfg).save_pretrained(d)
    GenerationConfig(decoder_start_token_id=1, eos_token_id=2, pad_token_id=0, max_length=6,
                     begin_suppress_tokens=[220, 50257], suppress_tokens=[1, 50358]).save_pretrained(d)
    model = WhisperForConditionalGeneration.from_pretrained(d)
    out = model.generate(torch.zeros(1, 8, 32), max_new_tokens=3)  # the processors mask 220 and 50257 away
    assert out.shape[0] == 1 and int(out.max()) < 64
    rc, found = verify(d)
    assert "config.generation_token_id" not in found and rc == 0, found


@pytest.mark.parametrize("stored,declared", [(torch.float16, "bfloat16"), (torch.bfloat16, "float16")])
def test_half_precision_weights_declared_in_the_other_half_are_lossy(tmp_path: Path, stored, declared) -> None:
    """Every weight stored in float16 with config.json saying bfloat16 (or the other way round):
    from_pretrained builds the model in the config's dtype and converts each weight, so the loaded
    weights are not the stored ones; verify says so with an error, in both modes."""
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    d = tmp_path / "m"
    model = LlamaForCausalLM(llama_config()).to(stored)
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight[0, 0] = 70000.0 if stored == torch.bfloat16 else 1.0009765625
    model.save_pretrained(d)
    rc, found = verify(d)
    assert rc == 0 and "config.dtype_lossy" not in found, found
    cfg = json.loads((d / "config.json").read_text())
    cfg["dtype"] = declared
    (d / "config.json").write_text(json.dumps(cfg))
    stored_q = load_file(d / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]
    loaded = LlamaForCausalLM.from_pretrained(d)
    assert str(loaded.dtype) == f"torch.{declared}"
    assert not torch.equal(loaded.model.layers[0].self_attn.q_proj.weight.float(), stored_q.float())  # changed
    for args in ((), ("--static",)):
        rc, found = verify(d, *args)
        assert rc == 1 and found.get("config.dtype_lossy") == "error" and "config.dtype_mismatch" not in found, found
