"""Steered log-probs: logprobe vs llama.cpp's control vectors, same GGUF model, same vector file.

    python bench/llamacpp_control_vector.py [--coeffs 0,2,4] [--layers 8:24]

(with llama-cpp-python installed elsewhere: ``python -c "import sys, runpy;
sys.path.append('/path/to/site-packages'); runpy.run_path('bench/llamacpp_control_vector.py',
run_name='__main__')"``)

Needs ``llama-cpp-python`` (not a logprobe dependency; it builds from source in minutes). The
vector is trained with ``Scorer.train_vector`` (Italy vs France prompts, as examples/steer_paris.py),
written as a control-vector GGUF, then applied by logprobe (``steer=[{"vector": path, "coeff": c}]``)
and by llama.cpp (``llama_apply_adapter_cvec``, what ``--control-vector-scaled path c`` does: each
``direction.{l}`` times c added to the output of block l). Both score the same token ids; the
table reports per-token |Δ log-prob| between the engines at each coefficient. At c = 0 the gap is
llama.cpp's own rounding (8-bit activations, f16 KV cache: see docs/perf.md); steering should not
widen it much if both put the vector at the same place.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from steer_paris import NEGATIVE, POSITIVE  # noqa: E402

from logprobe import Scorer  # noqa: E402
from logprobe.interp.vectors import read_vector_file  # noqa: E402

TEXTS = ["The capital of France is Paris. It is known for the Eiffel Tower and the Louvre museum.",
         "Last summer we drove through the south of the country, stopping in small villages for lunch.",
         "The committee will publish its report on the new railway line before the end of the year."]


def llama_cpp_logprobs(model_path: str, ids: list[int], cvec: np.ndarray | None, n_embd: int, n_layer: int):
    import llama_cpp

    params = llama_cpp.llama_model_default_params()
    if hasattr(params, "use_extra_bufts"):
        params.use_extra_bufts = False  # the repacked AMX kernels crash on this CPU (field notes)
    llm = llama_cpp.Llama(model_path=model_path, n_ctx=512, logits_all=True, verbose=False, n_threads=2,
                          **({"use_extra_bufts": False} if "use_extra_bufts" in llama_cpp.Llama.__init__.__code__.co_varnames else {}))
    ctx = llm.ctx
    apply = (getattr(llama_cpp, "llama_set_adapter_cvec", None) or getattr(llama_cpp, "llama_apply_adapter_cvec", None)
             or llama_cpp.llama_control_vector_apply)
    if cvec is not None:
        buf = np.ascontiguousarray(cvec, dtype=np.float32)
        rc = apply(ctx, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), buf.size, n_embd, 1, n_layer)
        if rc != 0:
            raise RuntimeError(f"control vector apply failed: {rc}")
    llm.reset()
    llm.eval(ids)
    logits = np.array(llm.scores[: len(ids)], dtype=np.float64)  # [n, V]
    lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    lp = logits[np.arange(len(ids) - 1), ids[1:]] - lse[:-1]
    llm.close() if hasattr(llm, "close") else None
    return torch.tensor(lp)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--coeffs", default="0,1,2,4")
    ap.add_argument("--layers", default="8:24")
    args = ap.parse_args()
    s = Scorer(device="cpu", dtype="float32", progress=False)
    L, H = s.loaded.model.config.num_layers, s.loaded.model.config.hidden_size
    a, b = (int(x) for x in args.layers.split(":"))
    vec = s.train_vector(POSITIVE, NEGATIVE, layers=range(a, b))
    path = Path(tempfile.mkdtemp()) / "italy.gguf"
    vec.save_gguf(path)
    dirs = read_vector_file(path, H, L)
    flat = np.zeros((L - 1) * H, dtype=np.float32)  # llama.cpp's buffer starts at layer 1
    for point, v in dirs.items():
        layer = int(point.split(".")[1])
        flat[(layer - 1) * H: layer * H] = v.numpy()
    print(f"model {s.info.path}\nvector: layers {a}..{b - 1}, pca_diff, unit norm per layer -> {path}\n")
    print("| coeff | tokens | logprobe mean lp | llama.cpp mean lp | mean abs Δ | max abs Δ | logprobe steered-vs-plain mean abs shift |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    plain = None
    for c in (float(x) for x in args.coeffs.split(",")):
        ours, theirs = [], []
        for text in TEXTS:
            ids = s.tokenizer.encode(text)
            seq = [{"prompt_token_ids": ids[:1], "completion_token_ids": ids[1:]}]
            steer = [{"vector": str(path), "coeff": c}] if c else None
            ours.append(s.logprobs(seq, steer=steer)[0].logprobs.double())
            theirs.append(llama_cpp_logprobs(str(s.info.path), ids, flat * c if c else None, H, L))
        x, y = torch.cat(ours), torch.cat(theirs)
        if plain is None:
            plain = x
        d = (x - y).abs()
        print(f"| {c:g} | {len(x)} | {x.mean():.4f} | {y.mean():.4f} | {d.mean():.4f} | {d.max():.4f} | "
              f"{(x - plain).abs().mean():.4f} |")


if __name__ == "__main__":
    main()
