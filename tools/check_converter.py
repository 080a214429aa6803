"""GGUFs written by llama.cpp's own converter, served by rtp, against transformers on the same weights.

The GGUF tests (tests/models/test_gguf_*.py) write their files the way llama.cpp's converter does; this
checks that reading against the converter itself. For each architecture, a tiny random transformers
model (tests/tiny_models.py's shapes, widened to the default model's 49,152-token tokenizer, so that the
converter recognises its pre-tokenizer) is saved, converted by llama.cpp's convert_hf_to_gguf.py
(--outtype f32), and served by rtp in fp32 from the GGUF: each prompt's greedy tokens against
transformers' from the saved directory, and the largest gap between the two engines' log-probabilities
of the tokens both chose.

    python tools/check_converter.py --llama-cpp PATH/TO/llama.cpp          # its checkout or sdist tree
    python tools/check_converter.py --llama-cpp PATH --kinds deepseek_v2,qwen3_moe

Output: a table, then as the last line of stdout one JSON object.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import REPO, error_text, note

sys.path.insert(0, str(REPO / "tests"))  # the tiny models' shapes, one definition with the tests'

NEW_TOKENS = 12
PROMPTS = [[5, 17, 93, 141, 2], [7] * 3 + list(range(20, 40)), list(range(100, 140))]


def _configs() -> dict:
    import transformers
    from tiny_models import DEEPSEEK, DENSE, MOE, MOE_CONFIGS

    v2 = {**DEEPSEEK, "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2, "norm_topk_prob": False,
          "q_lora_rank": None}
    # what the converter cannot write, left out: Qwen-MoE's dense layers (it maps no mlp.down_proj; the released
    # Qwen MoE models have none) and OLMoE's clip_qkv (OlmoeModel writes no clamp_kqv; OLMoE-1B-7B has none)
    fits = {"qwen2_moe": {"mlp_only_layers": []}, "qwen3_moe": {"decoder_sparse_step": 1}, "olmoe": {"clip_qkv": None}}
    out = {"llama": (transformers.LlamaConfig, DENSE)}
    out.update({kind: (cls, {**MOE, **extra, **fits.get(kind, {})}) for kind, (cls, extra) in MOE_CONFIGS.items()})
    out["deepseek_v2"] = (transformers.DeepseekV2Config, v2)
    out["deepseek_v3"] = (transformers.DeepseekV3Config, {**DEEPSEEK, "q_lora_rank": 48})
    return out


def check(kind: str, cls, keys: dict, tokenizer, converter: Path, work: Path) -> dict:
    import torch
    from tiny_models import random_hf_model

    from rtp import LLM, SamplingParams

    hf = random_hf_model(cls(**{**keys, "vocab_size": len(tokenizer)}))
    src, gguf = work / kind, work / f"{kind}.gguf"
    hf.save_pretrained(src)
    tokenizer.save_pretrained(src)
    done = subprocess.run([sys.executable, str(converter), str(src), "--outfile", str(gguf), "--outtype", "f32"],
                          capture_output=True, text=True, cwd=converter.parent)
    if done.returncode:
        return {"kind": kind, "error": "convert: " + " ".join(done.stderr.strip().splitlines()[-1:])}
    llm = LLM(model=str(gguf), dtype="float32", compile=False, max_model_len=128, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    ours = llm.generate(PROMPTS, params)
    same, gap = 0, 0.0
    for prompt, out in zip(PROMPTS, ours):
        with torch.no_grad():
            ids = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False, pad_token_id=0)[0]
            logprobs = torch.log_softmax(hf(ids[None]).logits[0].float(), dim=-1)
        theirs = ids[len(prompt):].tolist()
        got = out.outputs[0].token_ids
        same += got == theirs
        for i, (a, b) in enumerate(zip(got, theirs)):
            if a != b:
                break
            gap = max(gap, abs(out.outputs[0].logprobs[i][a] - logprobs[len(prompt) - 1 + i, a].item()))
    return {"kind": kind, "architecture": llm.engine.model.config.architecture, "prompts": len(PROMPTS),
            "greedy_equal": same, "max_logprob_gap": gap}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp", required=True, type=Path, help="llama.cpp's tree (holds convert_hf_to_gguf.py)")
    ap.add_argument("--kinds", default=None, help="comma-separated (default: every one)")
    args = ap.parse_args()
    converter = args.llama_cpp / "convert_hf_to_gguf.py"
    if not converter.exists():
        sys.exit(f"{converter}: not found")
    import transformers

    from rtp.checkpoint.default_model import default_model_path

    default = Path(default_model_path())
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(default.parent), gguf_file=default.name)
    configs = _configs()
    kinds = args.kinds.split(",") if args.kinds else list(configs)
    rows = []
    with tempfile.TemporaryDirectory(prefix="rtp-converter-") as tmp:
        for kind in kinds:
            note(kind)
            try:
                rows.append(check(kind, *configs[kind], tokenizer, converter, Path(tmp)))
            except Exception as e:  # noqa: BLE001 - one architecture's failure is a row of the table
                rows.append({"kind": kind, "error": error_text(e)})
    print(f"{'kind':14}{'rtp class':26}{'greedy equal':>14}{'max |dlogprob|':>16}")
    for r in rows:
        if "error" in r:
            print(f"{r['kind']:14}{r['error']}")
        else:
            print(f"{r['kind']:14}{r['architecture']:26}{r['greedy_equal']:>9} of {r['prompts']}"
                  f"{r['max_logprob_gap']:>16.2e}")
    print(json.dumps({"llama_cpp": str(args.llama_cpp), "rows": rows}))


if __name__ == "__main__":
    main()
