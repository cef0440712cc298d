"""Weights pushed over NCCL from a trainer process to ``logprobe serve`` (SGLang's protocol:
``/init_weights_update_group`` then ``/update_weights_from_distributed`` per bucket, the tensors
broadcast from rank 0), timed, then checked: the served scores equal a fresh Scorer's on the
new weights, bitwise (deterministic mode).

    GPU 1: logprobe serve (checkpoint A, seed 0)    <- HTTP + NCCL broadcast --  GPU 0: this process,
                                                                                  the trainer (weights B, seed 1)

Two random-init checkpoints of one shape are written (Llama-3-8B by default, bf16, Hugging Face
names; ``--layers`` cuts the decoder). The server is the real CLI in a subprocess on GPU 1
(``CUDA_VISIBLE_DEVICES=1,0``: it sees GPU 0 too, so NCCL may use peer-to-peer copies; its own
device is the first). This process loads B on GPU 0, joins the group as rank 0 (the store host,
built as SGLang's / OpenRLHF's ``init_custom_process_group``) and sends B in buckets of about
``--bucket-mb`` (a request naming the bucket's tensors, then one broadcast per tensor, as SGLang
trainers do); the last bucket's reply comes once the server applied every weight. Each full
update is timed (the first includes NCCL's connection set-up). Then a few requests are scored
over HTTP, the server is stopped and a fresh ``Scorer`` loads B on the same GPU in a child
process: the numbers must be equal bit for bit (and differ from the ones before the update).
``--nccl-socket`` sets ``NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1`` on both sides, as torchrl's
SGLang scheme does in the trainer (the transfer then goes through sockets). ``--client torchrl``
makes the trainer torchrl's ``SGLangWeightSyncScheme``, unchanged (one request naming every
tensor per update, generation paused around it; the server gets the scheme's NCCL settings).

    PYTHONPATH=src python3 bench/gpu_weight_sync.py                      # 2 GPUs, llama-8b, ~16 GB
    PYTHONPATH=src python3 bench/gpu_weight_sync.py --layers 4 --repeats 2
    PYTHONPATH=src python3 bench/gpu_weight_sync.py --nccl-socket
    PYTHONPATH=src python3 bench/gpu_weight_sync.py --client torchrl     # torchrl's scheme as the trainer
    PYTHONPATH=src python3 bench/gpu_weight_sync.py --tiny               # CPU, gloo, a tiny model

``--random SHAPE`` (a mixture-of-experts shape of ``bench/common.py``; ``--fp8``: FP8 blocks;
``--tp N``: the server at TP = EP = N) writes no checkpoint: the server makes its weights at random
(``serve --load-format dummy``, seed 0) and the trainer sends those of seed 1, made on its device
tensor by tensor as a checkpoint would hold them (``loading.dummy.random_checkpoint``: FP8 codes and
``weight_scale_inv``, experts one by one). The reference is a fresh scorer of seed 1 at the same TP:
bitwise. The trainer holds the whole update in memory (cut-down depths: ``--layers``); FP8 codes
are broadcast as bytes (gloo has no float8 type; the server receives bytes either way).

    PYTHONPATH=src python3 bench/gpu_weight_sync.py --random deepseek-v3 --fp8 --layers 4 --tp 4 --server-gpus 1,2,3,4,0
    PYTHONPATH=src python3 bench/gpu_weight_sync.py --random tiny-v3 --fp8 --tp 2 --tiny   # CPU, gloo

``--in-place`` joins the group ``in_place`` (each bucket written as it comes, scoring refused until
the round completes: no held copy of the weights, for models that fill their GPUs); the check is
the same. ``--stream`` makes the trainer's tensors one at a time during each update (a bucket at
a time in memory: the 671B shape's 700 GB never held whole), and leaves the time spent making them
out of the update's seconds (printed beside them).

    PYTHONPATH=src python3 bench/gpu_weight_sync.py --random deepseek-v3 --fp8 --tp 8 --stream --in-place \
        --server-gpus 1,2,3,4,5,6,7,0   # eight GPUs: the server on all, the trainer on GPU 0 beside rank 7
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import FP8_CONFIG, MODELS, MOE_SHAPES, byte_tokenizer, moe_config  # noqa: E402

T0 = time.perf_counter()
REPO = Path(__file__).resolve().parent.parent
TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=4096, rms_norm_eps=1e-5)
GROUP = "weight_update_group"

# the fresh reference, in a child process (on the GPU the server used): argv dir, device, dtype, requests,
# tensor-parallel size, random seed (-1: the checkpoint's weights)
REFERENCE = r'''
import json, sys
from logprobe import Scorer
from logprobe.loading.dummy import RandomWeights
path, device, dtype, reqs = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
tp, seed = int(sys.argv[5]), int(sys.argv[6])
s = Scorer(path, device=device, dtype=dtype, progress=False, deterministic=True, tensor_parallel_size=tp,
           load_format="auto" if seed < 0 else RandomWeights(seed=seed))
out = s.logprobs([{"prompt_token_ids": ids[:1], "completion_token_ids": ids[1:]} for ids in reqs])
print(json.dumps([r.logprobs.tolist() for r in out]))
'''


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f} s]", *a, flush=True)


def config(tiny: bool, layers: int):
    import transformers as tf

    kw = dict(TINY if tiny else MODELS["llama-8b"])
    if layers:
        kw["num_hidden_layers"] = layers
    return tf.LlamaConfig(**kw, bos_token_id=1, eos_token_id=2)


def write_checkpoint(cfg, seed: int, dtype: torch.dtype, path: Path, device: str) -> None:
    """Random weights under transformers' Llama names (seeded per tensor from ``seed``): norms near
    1, matrices N(0, 0.02); files of at most 4 GiB, config.json (written last) and a byte tokenizer."""
    import transformers as tf
    from safetensors.torch import save_file

    if (path / "config.json").exists():
        return
    path.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in tf.LlamaForCausalLM(cfg).state_dict().items()}
    index, part, size = {}, {}, 0

    def flush():
        name = f"model-{len(set(index.values())):05d}.safetensors"
        save_file(part, str(path / name))
        index.update({k: name for k in part})

    for i, (k, shape) in enumerate(sorted(shapes.items())):
        g = torch.Generator(device).manual_seed(seed * 100_003 + i)
        t = torch.randn(shape, generator=g, device=device)
        part[k] = (1 + 0.1 * t if len(shape) == 1 else 0.02 * t).to(dtype).cpu()
        size += part[k].numel() * part[k].element_size()
        if size > 4 << 30:
            flush()
            part, size = {}, 0
    if part:
        flush()
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    byte_tokenizer().save_pretrained(str(path))
    cfg.save_pretrained(str(path))


def write_random_config(shape: str, layers: int, fp8: bool, path: Path) -> None:
    """config.json and a byte tokenizer, no weights: the server makes them (``--load-format dummy``)."""
    if (path / "config.json").exists():
        return
    path.mkdir(parents=True, exist_ok=True)
    raw = moe_config(shape, layers).to_dict()
    (path / "config.json").write_text(json.dumps({**raw, **({"quantization_config": FP8_CONFIG} if fp8 else {})}))
    byte_tokenizer().save_pretrained(str(path))


def random_weights(path: Path, seed: int, device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The weights of the model ``load_format=RandomWeights(seed)`` makes from ``path``, under the
    names and in the layout a trainer sends (``loading.dummy.random_checkpoint``)."""
    return dict(random_stream(path, seed, device, dtype)())


def random_stream(path: Path, seed: int, device: str, dtype: torch.dtype):
    """-> a function making ``random_weights``' (name, tensor) pairs one at a time, afresh each call."""
    from logprobe.loading.dummy import RandomWeights, random_checkpoint
    from logprobe.loading.loader import describe_model
    from logprobe.loading.update import family, sent_names

    model = describe_model(str(path), "cpu", tokenizer=False).model
    raw = json.loads((path / "config.json").read_text())
    return lambda: random_checkpoint(family(model), model.config, raw, RandomWeights(seed=seed), device, dtype,
                                     lambda n: sent_names(model, [n])[0])


class Streamed:
    """The trainer's weights made tensor by tensor during each update, never all at once (a model
    larger than the trainer's GPU: ``--stream``). The first pass records each tensor's name, dtype,
    shape and bytes, and cuts the buckets (in the order they are made, at most ``limit`` bytes)."""

    def __init__(self, make, limit: int) -> None:
        self.make = make
        self.meta = [(n, t.dtype, list(t.shape), t.numel() * t.element_size()) for n, t in make()]
        self.nbytes = sum(m[3] for m in self.meta)
        self.parts: list[list[int]] = []
        size = 0
        for i, m in enumerate(self.meta):
            if self.parts and self.parts[-1] and size + m[3] <= limit:
                self.parts[-1].append(i)
                size += m[3]
            else:
                self.parts.append([i])
                size = m[3]

    def update(self, url: str, pg, version: str) -> tuple[dict, float]:
        """One full update, each tensor made just before its broadcast; -> (the last reply, seconds
        spent making tensors)."""
        made, reply, tensors = [0.0], None, self.make()

        def timed(part: list[int]):
            for _ in part:
                t = time.perf_counter()
                _, w = next(tensors)
                if w.is_cuda:
                    torch.cuda.synchronize()
                made[0] += time.perf_counter() - t
                yield w

        for j, part in enumerate(self.parts):
            reply = send_bucket(url, pg, [self.meta[i][:3] for i in part], timed(part),
                                version if j == len(self.parts) - 1 else None)
        return reply, made[0]


def load_weights(path: Path, device: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("model-*.safetensors")):
        out.update(load_file(str(f), device=device))
    return dict(sorted(out.items()))


def buckets(weights: dict[str, torch.Tensor], limit: int) -> list[list[str]]:
    """The names in order, cut into runs of at most ``limit`` bytes (a tensor larger goes alone)."""
    out, cur, size = [], [], 0
    for name in sorted(weights):
        n = weights[name].numel() * weights[name].element_size()
        if cur and size + n > limit:
            out.append(cur)
            cur, size = [], 0
        cur.append(name)
        size += n
    return out + ([cur] if cur else [])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: dict | None = None, timeout: float = 600.0) -> tuple[int, dict]:
    """POST ``body`` as JSON (GET when None); -> (status, decoded reply)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


class Call(threading.Thread):
    """An HTTP request beside the collective (the server answers only once the broadcasts are done)."""

    def __init__(self, url: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body, self.reply = url, body, None

    def run(self):
        try:
            self.reply = http(self.url, self.body)
        except Exception as e:  # noqa: BLE001 - reported by result()
            self.reply = (0, {"message": f"{type(e).__name__}: {e}"})

    def result(self) -> dict:
        self.join()
        status, reply = self.reply
        if status != 200 or not reply.get("success"):
            raise SystemExit(f"{self.url} failed: {status} {json.dumps(reply)[:2000]}")
        return reply


def trainer_group(port: int, world_size: int, backend: str, timeout: float = 600.0):
    """Rank 0 of the weight update group, built as SGLang's / OpenRLHF's trainers build it: the
    trainer hosts the TCP store, a PrefixStore of the group name, no default process group."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    t = timedelta(seconds=timeout)
    store, rank, world_size = next(rendezvous(f"tcp://127.0.0.1:{port}", 0, world_size, timeout=t))
    store.set_timeout(t)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(GROUP, store),
                                      group_name=GROUP, timeout=t)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def send_bucket(url: str, pg, meta: list, tensors, version: str | None) -> dict:
    """One bucket: the request naming ``meta``'s (name, dtype, shape) (and ``version``, on an
    update's last), then each of ``tensors`` broadcast from rank 0; -> the server's reply."""
    import torch.distributed as dist

    call = Call(url + "/update_weights_from_distributed", {
        "names": [m[0] for m in meta], "dtypes": [str(m[1]).removeprefix("torch.") for m in meta],
        "shapes": [list(m[2]) for m in meta], "group_name": GROUP,
        **({"weight_version": version} if version is not None else {})})
    call.start()
    w = None
    for w in tensors:  # FP8 codes as bytes (gloo has no float8; the server receives bytes)
        dist.broadcast(w.view(torch.uint8) if w.dtype == torch.float8_e4m3fn else w, src=0, group=pg)
    if w is not None and w.is_cuda:
        torch.cuda.synchronize()
    return call.result()


def update(url: str, pg, weights: dict[str, torch.Tensor], parts: list[list[str]], version: str) -> dict:
    """One full update: per bucket, the request, then each tensor broadcast from rank 0."""
    reply = None
    for j, names in enumerate(parts):
        reply = send_bucket(url, pg, [(n, weights[n].dtype, weights[n].shape) for n in names],
                            (weights[n] for n in names), version if j == len(parts) - 1 else None)
    return reply


def leave(url: str, pg) -> None:
    """Both sides leave the group (the server first, as SGLang trainers do); a hang is reported, not waited on."""
    import torch.distributed as dist

    try:
        status, reply = http(url + "/destroy_weights_update_group", {"group_name": GROUP}, timeout=120)
        log(f"server left the group: {status} {reply.get('message')}")
    except OSError as e:
        log(f"destroy_weights_update_group: no answer ({e})")
    t = threading.Thread(target=dist.destroy_process_group, args=(pg,), daemon=True)
    t.start()
    t.join(timeout=60)
    log("trainer left the group" if not t.is_alive() else "trainer: destroy_process_group still running after 60 s")


def push_buckets(url: str, weights: dict[str, torch.Tensor], nbytes: int, parts: list[list[str]], args) -> list:
    """This process as an SGLang-style trainer: its own group, one request per bucket; -> table rows."""
    mport, backend, rows = free_port(), ("gloo" if args.tiny else "nccl"), []
    init = Call(url + "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": mport, "rank_offset": 1, "world_size": 2,
        "group_name": GROUP, "backend": backend, **({"in_place": True} if args.in_place else {})})
    init.start()
    t = time.perf_counter()
    joined: list = []
    joiner = threading.Thread(target=lambda: joined.append(trainer_group(mport, 2, backend)), daemon=True)
    joiner.start()
    while joiner.is_alive():  # the server refusing to join ends the run here, not at the group's timeout
        joiner.join(0.2)
        if not init.is_alive() and init.reply[0] != 200:
            init.result()
    pg = joined[0]
    log(f"group joined ({backend}): {init.result()['message']} ({time.perf_counter() - t:.2f} s)")
    for r in range(args.repeats):
        t = time.perf_counter()
        if isinstance(weights, Streamed):  # the time spent making tensors is not the update's
            reply, made = weights.update(url, pg, f"step-{r + 1}")
        else:
            reply, made = update(url, pg, weights, parts, f"step-{r + 1}"), 0.0
        secs = time.perf_counter() - t - made
        rows.append((r + 1, secs, nbytes / secs / 1e9, reply["weight_version"]))
        log(f"update {r + 1}: {secs:.3f} s ({nbytes / 1e9:.2f} GB, {nbytes / secs / 1e9:.1f} GB/s)"
            + (f", and {made:.3f} s making the tensors" if made else "") + f": {reply['message']}")
    leave(url, pg)
    return rows


def push_torchrl(url: str, weights: dict[str, torch.Tensor], nbytes: int, repeats: int) -> list:
    """torchrl's SGLangWeightSyncScheme, as released: one request naming every tensor per update,
    generation paused around it; it sets NCCL_P2P_DISABLE / NCCL_SHM_DISABLE here (the server was
    started with the same). -> table rows (the scheme names no version: the server counts)."""
    from torchrl.weight_update.llm import SGLangWeightSyncScheme

    scheme = SGLangWeightSyncScheme(server_url=url, master_address="127.0.0.1", num_gpus=1, strategy="state_dict",
                                    device=0)
    sender = scheme.create_sender()
    t = time.perf_counter()
    sender.init_all_workers_group({k: (v.dtype, v.shape) for k, v in weights.items()})
    log(f"group joined (torchrl, nccl) ({time.perf_counter() - t:.2f} s)")
    rows = []
    for r in range(repeats):
        t = time.perf_counter()
        sender.update_weights(weights=weights)
        secs = time.perf_counter() - t
        _, version = http(url + "/get_weight_version", timeout=30)
        rows.append((r + 1, secs, nbytes / secs / 1e9, version["weight_version"]))
        log(f"update {r + 1} (torchrl): {secs:.3f} s ({nbytes / 1e9:.2f} GB, {nbytes / secs / 1e9:.1f} GB/s)")
    sender.shutdown()
    return rows


def start_server(path: Path, port: int, args, env: dict) -> tuple[subprocess.Popen, Path]:
    device, dtype = ("cpu", "float32") if args.tiny else ("cuda:0", "bfloat16")
    logfile = Path(args.dir) / "server.log"
    cmd = [sys.executable, "-m", "logprobe.cli.main", "serve", "--model", str(path), "--device", device,
           "--dtype", dtype, "--deterministic", "--port", str(port), "--log-level", "warning", "--quiet"]
    if args.random:  # seed 0 at random, at TP = EP = N
        cmd += ["--load-format", "dummy", "--tp", str(args.tp)]
    log("server:", " ".join(cmd))
    with open(logfile, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 900
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit("the server exited:\n" + logfile.read_text()[-4000:])
        try:
            if http(url + "/health", timeout=2)[0] == 200:
                return proc, logfile
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not come up:\n" + logfile.read_text()[-4000:])


def score(url: str, reqs: list[list[int]]) -> tuple[list[list[float]], str]:
    out, version = [], None
    for ids in reqs:
        status, reply = http(url + "/generate", {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0})
        if status != 200:
            raise SystemExit(f"/generate failed: {status} {json.dumps(reply)[:2000]}")
        out.append([e[0] for e in reply["meta_info"]["input_token_logprobs"][1:]])
        version = reply["meta_info"]["weight_version"]
    return out, version


def reference(path: Path, reqs: list[list[int]], args, env: dict) -> list[list[float]]:
    device, dtype = ("cpu", "float32") if args.tiny else ("cuda:0", "bfloat16")
    p = subprocess.run([sys.executable, "-c", REFERENCE, str(path), device, dtype, json.dumps(reqs), str(args.tp),
                        "1" if args.random else "-1"], env=env, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        raise SystemExit("the reference Scorer failed:\n" + p.stderr[-4000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(float((torch.tensor(x, dtype=torch.float64) - torch.tensor(y, dtype=torch.float64)).abs().max())
               for x, y in zip(a, b))


def environments(args) -> tuple[dict, dict]:
    """(the server's, the reference child's) environment; this process's NCCL settings are set here."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH")) if p)}
    if args.nccl_socket:
        for k in ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE"):
            os.environ[k] = env[k] = "1"
    server = {**env, **dict(kv.split("=", 1) for kv in args.server_env)}
    nccl = {k: v for k, v in server.items() if k.startswith("NCCL_")}
    log("NCCL settings, server:", nccl or "none", "| trainer:", {k: v for k, v in os.environ.items()
                                                                  if k.startswith("NCCL_")} or "none")
    if args.tiny:
        return server, env
    ref_gpus = ",".join(args.server_gpus.split(",")[:max(args.tp, 1)])
    return {**server, "CUDA_VISIBLE_DEVICES": args.server_gpus}, {**env, "CUDA_VISIBLE_DEVICES": ref_gpus}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU, gloo, a tiny float32 Llama (a smoke run)")
    ap.add_argument("--layers", type=int, default=0, help="fewer decoder layers (default: all 32)")
    ap.add_argument("--bucket-mb", type=float, default=0, help="bucket size in MiB (default 1024; 0.05 with --tiny)")
    ap.add_argument("--repeats", type=int, default=3, help="full updates timed")
    ap.add_argument("--requests", type=int, default=4, help="sequences scored after the updates")
    ap.add_argument("--server-gpus", default="1,0", help="the server's CUDA_VISIBLE_DEVICES (it runs on the first)")
    ap.add_argument("--nccl-socket", action="store_true", help="NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 (torchrl's)")
    ap.add_argument("--client", default="buckets", choices=["buckets", "torchrl"],
                    help="the trainer: this script's SGLang-style buckets, or torchrl's SGLangWeightSyncScheme "
                         "unchanged (CUDA only; implies --nccl-socket, which the scheme sets)")
    ap.add_argument("--server-env", action="append", default=[], metavar="K=V",
                    help="an environment variable for the server alone (repeatable), e.g. NCCL_SOCKET_NTHREADS=4: "
                         "NCCL's socket transport takes its socket count from the receiving side")
    ap.add_argument("--random", default=None, choices=sorted(MOE_SHAPES), metavar="SHAPE",
                    help="no checkpoint: the server makes SHAPE at random (seed 0), the trainer sends seed 1's "
                         f"weights (one of {', '.join(sorted(MOE_SHAPES))})")
    ap.add_argument("--fp8", action="store_true", help="with --random: FP8 blocks (DeepSeek's layout)")
    ap.add_argument("--tp", type=int, default=1, help="with --random: the server at TP = EP = N")
    ap.add_argument("--in-place", action="store_true",
                    help="the group joined in_place: each bucket written as it comes (no held copy of the weights)")
    ap.add_argument("--stream", action="store_true",
                    help="with --random: the trainer makes each tensor just before its broadcast, never holding "
                         "the update (models larger than its GPU); the update's seconds leave the making out")
    ap.add_argument("--dir", default="/tmp/logprobe-weight-sync")
    args = ap.parse_args()
    if (args.fp8 or args.tp != 1 or args.stream) and not args.random:
        raise SystemExit("--fp8, --tp and --stream go with --random")
    if args.stream and args.client == "torchrl":
        raise SystemExit("--stream sends this script's buckets: drop --client torchrl")
    for kv in args.server_env:
        if "=" not in kv:
            raise SystemExit(f"--server-env wants K=V, got {kv!r}")
    if args.client == "torchrl":
        if args.tiny:
            raise SystemExit("--client torchrl needs CUDA and NCCL (the scheme hard-codes them): drop --tiny")
        args.nccl_socket = True
    if not args.tiny and torch.cuda.device_count() < 2:
        raise SystemExit(f"needs 2 CUDA devices (this machine has {torch.cuda.device_count()}); or pass --tiny")
    server_env, ref_env = environments(args)
    if not args.tiny:
        torch.cuda.set_device(0)  # the trainer's GPU (NCCL binds its communicator to the current device)
    dtype, dev = (torch.float32, "cpu") if args.tiny else (torch.bfloat16, "cuda:0")
    if args.random:
        cfg = moe_config(args.random, args.layers)
        label = f"{args.random}-{args.layers or 'all'}{'-fp8' * args.fp8}-random-tp{args.tp}"
        paths = dict.fromkeys((0, 1), Path(args.dir) / label)
        write_random_config(args.random, args.layers, args.fp8, paths[0])
    else:
        cfg = config(args.tiny, args.layers)
        label = f"{'tiny' if args.tiny else 'llama-8b'}-{args.layers or 'all'}"
        paths = {s: Path(args.dir) / f"{label}-seed{s}" for s in (0, 1)}
        for s, p in paths.items():
            t = time.perf_counter()
            write_checkpoint(cfg, s, dtype, p, dev)
            log(f"checkpoint {p} ({time.perf_counter() - t:.1f} s)")
    rng = random.Random(0)
    lengths = [16, 40, 9, 64] if args.tiny else [128, 1024, 37, 2048, 512, 3000]
    reqs = [[rng.randrange(3, cfg.vocab_size) for _ in range(lengths[i % len(lengths)])] for i in range(args.requests)]

    port = free_port()
    proc, logfile = start_server(paths[0], port, args, server_env)
    url = f"http://127.0.0.1:{port}"
    rows = []
    try:
        log("server up")
        before, v0 = score(url, reqs)
        t = time.perf_counter()
        limit = int((args.bucket_mb or (0.05 if args.tiny else 1024)) * 2**20)
        if args.stream:
            weights = Streamed(random_stream(paths[1], 1, dev, dtype), limit)
            nbytes, parts, count = weights.nbytes, weights.parts, len(weights.meta)
        else:
            weights = random_weights(paths[1], 1, dev, dtype) if args.random else load_weights(paths[1], dev)
            nbytes, parts, count = sum(t.numel() * t.element_size() for t in weights.values()), None, len(weights)
            parts = buckets(weights, limit)
        log(f"trainer's weights made or read ({time.perf_counter() - t:.1f} s)")
        log(f"trainer: {count} tensors, {nbytes / 2**30:.2f} GiB, {len(parts)} buckets")
        if args.client == "torchrl":
            rows = push_torchrl(url, weights, nbytes, args.repeats)
        else:
            rows = push_buckets(url, weights, nbytes, parts, args)
        after, v1 = score(url, reqs)
        _, version = http(url + "/get_weight_version", timeout=30)
    except BaseException:
        log("failed; the server's log ends:\n" + logfile.read_text()[-4000:])
        raise
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    del weights
    if not args.tiny:
        torch.cuda.empty_cache()
    log("server stopped; a fresh Scorer loads the new weights")
    fresh = reference(paths[1], reqs, args, ref_env)
    report(args, label, nbytes, parts, rows, reqs, before, after, fresh, (v0, v1, version))


def report(args, label, nbytes, parts, rows, reqs, before, after, fresh, versions) -> None:
    v0, v1, version = versions
    how = "torchrl's SGLangWeightSyncScheme, one request" if args.client == "torchrl" else f"{len(parts)} buckets"
    print(f"\n## weight sync ({'gloo, CPU' if args.tiny else 'NCCL'}{', sockets' if args.nccl_socket else ''}): "
          f"{label}, {nbytes / 1e9:.2f} GB, {how}\n")
    print("| update | seconds | GB/s | weight_version |\n|---|---|---|---|")
    for r, secs, rate, name in rows:
        print(f"| {r} | {secs:.3f} | {rate:.1f} | {name} |")
    last = str(args.repeats) if args.client == "torchrl" else f"step-{args.repeats}"
    ok_version = v0 == "0" and v1 == version["weight_version"] == last
    print(f"\nweight_version: {v0} before, {v1} after ({'ok' if ok_version else 'failed'})\n")
    print("| request | tokens scored | bitwise vs fresh Scorer | max |Δ| vs fresh | max |Δ| vs before |\n|---|---|---|---|---|")
    same = []
    for i, ids in enumerate(reqs):
        same.append(after[i] == fresh[i])
        print(f"| {i} | {len(ids) - 1} | {'yes' if same[-1] else 'failed'} | {max_diff([after[i]], [fresh[i]]):.3g} | "
              f"{max_diff([after[i]], [before[i]]):.3g} |")
    changed = after != before
    print(f"\nscores after the update equal a fresh Scorer's bitwise: {'yes' if all(same) else 'failed'}; "
          f"they differ from the ones before: {'yes' if changed else 'failed'}")
    if not (all(same) and changed and ok_version):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
