"""The model-class check's cost (issue 30): what ``verify`` pays to import torch and transformers
and build the class on the meta device, against the import alone and against ``verify --static``.

* ``moe``: the 91,991 names of DeepSeek-V3 in 163 shards (:class:`bench.gen.MoeSpec`, the
  checkpoint of ``metadata-moe``), hard-linked, beside its config without ``quantization_config``,
  so DeepseekV3ForCausalLM is built at full size (61 layers, 256 experts) with float layers and
  the loader's matching runs over every key (the fp8 ``weight_scale_inv`` tensors are UNEXPECTED:
  the worst case for it); and the generated checkpoint itself, its fp8 ``quantization_config``
  kept, built with transformers' fp8 quantizer (``FP8Linear``/``FP8Experts``). verify exits 1 on
  both (the generator's shapes are not DeepSeek's, and the first has quantized tensors without a
  quantization_config), which the commands accept.
* ``llama70b``: Llama-3-70B's config (80 layers, 8192 hidden, 128,256 vocab); its 723 header
  entries are made from the config (no 140 GB file), and the check is called as verify calls it.

* ``10 small``: ten hard-linked copies of a 4 MB Llama (``Spec(4 MB, single)``) verified in one
  call, against one of them alone: the class check runs in the box's child process (issue 44),
  one per verify run, so the ten pay the library import once (the difference is ten builds of a
  tiny class).

Target: the class check's cost over ``--static`` at most the library import time + 2 s, and peak
RSS under 1 GiB (the peak of verify and of the box's child, which verify waits for). The import is what ``from_pretrained`` of these models imports (``import
transformers`` alone is lazy: its modeling code, which brings torch's compiler modules, is most of
the cost).
"""

from __future__ import annotations

import json
import sys
from functools import partial

from bench.cases.resave import linked_copy
from bench.gen import WORK, MoeSpec, Spec, ensure
from bench.harness import CKPTCTL, Case, Command

SPEC = MoeSpec()
SRC = WORK / SPEC.name()  # the generated checkpoint (ensure), its fp8 quantization_config kept
MOE = WORK / "out" / "moe-class"
SMALL = Spec(size=4 * 10**6, single=True)
TEN = [WORK / "out" / "class-ten" / str(i) for i in range(10)]  # linked copies of SMALL
LLAMA_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
             "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
             "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
             "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
# what from_pretrained of either model imports: torch, transformers' modeling code and the classes
LIBRARY_IMPORT = "import torch, transformers; transformers.LlamaForCausalLM; transformers.DeepseekV3ForCausalLM"
# the header entries of a Llama checkpoint, from its config, then verify's class check on them
LLAMA_CHECK = (
    "import json, sys\n"
    "from ckptctl.format.tensor import TensorSpec\n"
    "from ckptctl.verify.classes.transformers_class import check_transformers\n"
    "c = json.loads(sys.argv[1])\n"
    "h, i, v = c['hidden_size'], c['intermediate_size'], c['vocab_size']\n"
    "hd = h // c['num_attention_heads']\n"
    "q, kv = c['num_attention_heads'] * hd, c['num_key_value_heads'] * hd\n"
    "shapes = {'model.embed_tokens.weight': (v, h), 'model.norm.weight': (h,), 'lm_head.weight': (v, h)}\n"
    "for n in range(c['num_hidden_layers']):\n"
    "    p = f'model.layers.{n}.'\n"
    "    shapes.update({p + 'self_attn.q_proj.weight': (q, h), p + 'self_attn.k_proj.weight': (kv, h),\n"
    "                   p + 'self_attn.v_proj.weight': (kv, h), p + 'self_attn.o_proj.weight': (h, q),\n"
    "                   p + 'mlp.gate_proj.weight': (i, h), p + 'mlp.up_proj.weight': (i, h),\n"
    "                   p + 'mlp.down_proj.weight': (h, i), p + 'input_layernorm.weight': (h,),\n"
    "                   p + 'post_attention_layernorm.weight': (h,)})\n"
    "specs = {k: TensorSpec(k, 'BF16', s) for k, s in shapes.items()}\n"
    "o = check_transformers(c, specs, 'llama-70b')\n"
    "assert len(specs) == 723 and not (o.missing or o.unexpected or o.mismatched), o\n"
)


def _prepare() -> None:
    small = ensure(SMALL)
    for d in TEN:
        if not (d / "config.json").is_file():
            linked_copy(small, d)
    src = ensure(SPEC)
    if not (MOE / "config.json").is_file() or "quantization_config" in json.loads((MOE / "config.json").read_text()):
        linked_copy(src, MOE)
        cfg = json.loads((src / "config.json").read_text())
        del cfg["quantization_config"]
        (MOE / "config.json").unlink()  # a hard link to the source's: write a new file
        (MOE / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def _accept_findings(argv: list[str]) -> str:
    """A shell line that runs ``argv`` and accepts exit 1 (findings), not 2 or 3."""
    import shlex

    return f"{shlex.join(argv)}; [ $? -le 1 ]"


def _cases() -> list[Case]:
    return [
        Case("model-class", "verify's model-class check: library import, class built on the meta device, "
             "the loader's key matching (91,991 DeepSeek-V3 names; a Llama-70B config)",
             [Command("import the library", [sys.executable, "-c", LIBRARY_IMPORT]),
              Command("verify --static (moe)", _accept_findings([*CKPTCTL, "verify", str(MOE), "-q", "--static"])),
              Command("verify, class check (moe)", _accept_findings([*CKPTCTL, "verify", str(MOE), "-q"])),
              Command("verify, class check (moe, fp8 config)", _accept_findings([*CKPTCTL, "verify", str(SRC), "-q"])),
              Command("class check (llama-70b)", [sys.executable, "-c", LLAMA_CHECK, json.dumps(LLAMA_70B)]),
              Command("verify, class check (1 small)", _accept_findings([*CKPTCTL, "verify", str(TEN[0]), "-q"])),
              Command("verify, class check (10 small, one call)",
                      _accept_findings([*CKPTCTL, "verify", *map(str, TEN), "-q"]))],
             prepare=partial(_prepare)),
    ]


CASES = _cases()
