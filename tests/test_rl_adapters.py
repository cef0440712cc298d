"""RL framework adapters (logprobe.integrations.trl / verl / openrlhf) against the frameworks' own code.

Each test runs the real library (skipped with a reason when it is not installed) and compares the
adapter's tensors with what the framework computes itself on the same tiny random model, in
float32 on CPU.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
from helpers import make_hf_dir

TOL = 1e-4  # float32 on CPU: logprobe's packed engine vs the framework's padded transformers forward


def needs(module: str):
    return pytest.mark.skipif(importlib.util.find_spec(module) is None,
                              reason=f"{module} is not installed (pip install -e '.[test]')")


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("rl-policy")
    make_hf_dir(d, "llama", seed=0)
    return d


@pytest.fixture(scope="module")
def ref_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("rl-ref")
    make_hf_dir(d, "qwen3", seed=1)  # another family and other weights than the policy
    return d


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def test_importing_logprobe_imports_no_rl_framework():
    import subprocess

    # the verl and OpenRLHF adapters' layout functions need neither framework either
    code = ("import sys, logprobe, logprobe.integrations, logprobe.integrations.verl, "
            "logprobe.integrations.openrlhf; "
            "print(sorted(m for m in ('trl', 'verl', 'openrlhf', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# -- TRL ------------------------------------------------------------------------------------------

@needs("trl")
def test_trl_grpo_two_steps_reference_from_logprobe(policy_dir, ref_dir, tmp_path):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    from logprobe.integrations.trl import LogprobeReference, LogprobeRefGRPOTrainer

    temperature = 0.7
    trl_reference = hf_model(ref_dir)  # TRL's own reference: the HF model with TRL's fused head
    add_fused_lm_head(trl_reference, temperature=temperature)

    class Recording(LogprobeRefGRPOTrainer):
        """Asks TRL's own code for the reference log-probs beside every logprobe answer."""

        pairs: list = []

        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, **kw):
            out = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, **kw)
            if isinstance(model, LogprobeReference):
                theirs = GRPOTrainer._get_per_token_logps_and_entropies(
                    self, trl_reference, input_ids, attention_mask, logits_to_keep, batch_size=kw.get("batch_size"))
                self.pairs.append((out[0], theirs[0], input_ids, attention_mask, logits_to_keep))
            return out

    prompts = Dataset.from_dict({"prompt": ["ab", "hello", "xyz q", "t", "logprobe", "rl"]})
    args = GRPOConfig(output_dir=str(tmp_path), beta=0.1, temperature=temperature, max_steps=2,
                      per_device_train_batch_size=4, num_generations=2, max_completion_length=6,
                      learning_rate=1e-2, bf16=False, use_cpu=True, report_to="none", save_strategy="no",
                      logging_steps=1, disable_tqdm=True, seed=0)
    trainer = Recording(model=str(policy_dir), reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
                        args=args, train_dataset=prompts, ref_model_path=str(ref_dir),
                        ref_scorer_kwargs={"device": "cpu", "dtype": "float32", "progress": False})
    assert trainer.beta == 0.1 and args.beta == 0.1
    trainer.train()

    assert len(Recording.pairs) == 2  # one reference batch per GRPO step
    worst = 0.0
    for ours, theirs, ids, mask, k in Recording.pairs:
        assert ours.shape == theirs.shape == (ids.shape[0], k) and ours.dtype == torch.float32
        assert (ours[mask[:, -k:] == 0] == 0).all()
        worst = max(worst, float((ours - theirs.float()).abs().max()))
    print(f"TRL GRPO reference log-probs: max |logprobe - TRL| = {worst:.2e}")
    assert worst <= TOL
    # the comparison can fail: the temperature and the reference model both change the numbers
    ours, _, ids, mask, k = Recording.pairs[-1]
    cold = trainer.ref_model.scorer.logprobs_padded(ids, mask, num_response_tokens=k).logprobs
    assert float((cold - ours).abs().max()) > 1e-2
    policy = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, k)[0]
    assert float((policy.float() - ours).abs().max()) > 1e-2


@needs("trl")
def test_trl_refuses_beta_zero(policy_dir, tmp_path):
    from trl import GRPOConfig

    from logprobe.errors import LogprobeError
    from logprobe.integrations.trl import LogprobeRefGRPOTrainer

    with pytest.raises(LogprobeError, match="args.beta"):
        LogprobeRefGRPOTrainer(model=str(policy_dir), reward_funcs=lambda completions, **_: [0.0] * len(completions),
                               args=GRPOConfig(output_dir=str(tmp_path), beta=0.0, use_cpu=True, report_to="none"),
                               ref_model_path=str(policy_dir))


# -- verl -----------------------------------------------------------------------------------------

def verl_batch(temperature: float):
    """A rollout batch as verl lays it out: prompts left-padded, responses right-padded; row 1 holds
    a tool token (attention 1, response_mask 0) inside its response."""
    from verl import DataProto

    g = torch.Generator().manual_seed(3)
    P, R = 5, 6
    prompt_lens, response_lens = [2, 5, 3, 1], [4, 6, 1, 5]
    prompts = torch.zeros(4, P, dtype=torch.long)  # pad id 0
    responses = torch.zeros(4, R, dtype=torch.long)
    attention = torch.zeros(4, P + R, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        prompts[b, P - p:] = torch.randint(2, 258, (p,), generator=g)
        responses[b, :r] = torch.randint(2, 258, (r,), generator=g)
        attention[b, P - p:P + r] = 1
    response_mask = attention[:, P:].clone()
    response_mask[1, 2] = 0  # a tool observation token
    position_ids = (attention.cumsum(1) - 1).clamp(min=0)  # verl's compute_position_id_with_mask
    return DataProto.from_dict(
        tensors={"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
                 "attention_mask": attention, "response_mask": response_mask, "position_ids": position_ids},
        meta_info={"temperature": temperature})


def verl_reference(model, data) -> torch.Tensor:
    """verl's actor: transformers forward, logits / T, logprobs_from_logits on the response span,
    then 0 after each response (verl 0.9's no_padding_2_padding)."""
    from verl.utils.torch_functional import logprobs_from_logits

    b = data.batch
    R = b["responses"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                       position_ids=b["position_ids"], use_cache=False).logits
    logits = logits[:, -R - 1:-1].float() / data.meta_info["temperature"]
    return logprobs_from_logits(logits, b["responses"]) * b["attention_mask"][:, -R:]


@needs("verl")
def test_verl_ref_log_prob_matches_verl(ref_dir):
    import types

    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    from logprobe.integrations.verl import LogprobeRefPolicy

    data = verl_batch(temperature=0.8)
    expected = verl_reference(hf_model(ref_dir), data)  # [4, 6]
    worker = LogprobeRefPolicy(str(ref_dir), device="cpu", dtype="float32", progress=False)
    worker.init_model()

    padded = worker.compute_ref_log_prob(data).batch["ref_log_prob"]  # the DataProto contract
    # verl 0.9's own trainer step: DataProto -> no-padding TensorDict -> worker -> no_padding_2_padding
    trainer = types.SimpleNamespace(ref_in_actor=False, ref_policy_wg=worker)
    nopad = RayPPOTrainer._compute_ref_log_prob(trainer, data).batch["ref_log_prob"]

    assert padded.shape == nopad.shape == (4, 6) and padded.dtype == nopad.dtype == torch.float32
    worst = max(float((padded - expected).abs().max()), float((nopad - expected).abs().max()))
    print(f"verl ref_log_prob: max |logprobe - verl| = {worst:.2e}")
    assert worst <= TOL
    assert torch.equal(padded, nopad)  # the same requests either way
    real = data.batch["attention_mask"][:, -6:].bool()
    assert (padded[~real] == 0).all() and (padded[real] != 0).all()  # the tool token is scored too
    # the comparison can fail: without the temperature the numbers move
    data.meta_info["temperature"] = 1.0
    assert float((worker.compute_ref_log_prob(data).batch["ref_log_prob"] - expected).abs().max()) > 1e-2


# -- OpenRLHF -------------------------------------------------------------------------------------

@pytest.fixture
def openrlhf_actor_class(monkeypatch):
    """``openrlhf.models.actor.Actor``. flash-attn has CUDA wheels only, and OpenRLHF's padding helpers
    import ``flash_attn.bert_padding`` at module level: while the module is imported, that name holds
    verl's pure-PyTorch equivalents of flash-attn's functions (``verl.utils.attention_utils``, what verl
    itself runs without flash-attn); ring attention's ``all_gather`` raises. The shim is removed after
    the import (OpenRLHF's ``log_probs_from_logits`` then finds no flash-attn and uses PyTorch)."""
    import types

    pytest.importorskip("deepspeed", reason="OpenRLHF's models import deepspeed")
    au = pytest.importorskip("verl.utils.attention_utils", reason="verl supplies flash-attn's padding helpers")
    if "openrlhf.models.actor" not in sys.modules and importlib.util.find_spec("flash_attn") is None:
        bert = types.ModuleType("flash_attn.bert_padding")
        bert.index_first_axis, bert.pad_input = au._fallback_index_first_axis, au._fallback_pad_input
        bert.unpad_input, bert.rearrange = au._fallback_unpad_input, au._fallback_rearrange
        dist = types.ModuleType("flash_attn.utils.distributed")

        def all_gather(*args, **kwargs):
            raise RuntimeError("ring attention is not available in this test")

        dist.all_gather = all_gather
        for name, mod in [("flash_attn", types.ModuleType("flash_attn")), ("flash_attn.bert_padding", bert),
                          ("flash_attn.utils", types.ModuleType("flash_attn.utils")),
                          ("flash_attn.utils.distributed", dist)]:
            monkeypatch.setitem(sys.modules, name, mod)
    from openrlhf.models.actor import Actor

    return Actor


def openrlhf_batches():
    """OpenRLHF 0.11.2 rollouts (right-padded rows, action_mask = mask[1:], A = L - 1, with an
    observation token in row 1) and the older layout (left-padded prompts, A = response length)."""
    g = torch.Generator().manual_seed(5)
    L = 12
    seq = torch.randint(2, 258, (3, L), generator=g)
    attn = torch.tensor([[1] * 9 + [0] * 3, [1] * 12, [1] * 5 + [0] * 7])
    act = torch.zeros(3, L - 1, dtype=torch.long)
    act[0, 2:8] = 1      # prompt of 3 tokens, 6 actions
    act[1, 0:11] = 1     # prompt of 1 token
    act[1, 5:7] = 0      # an observation inside the response
    act[2, 1:4] = 1
    new_attn = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 0, 0], [1] * 10, [0, 0, 0, 0, 1, 1, 1, 0, 0, 0]])
    new_act = new_attn[:, -5:].clone()  # responses: the last 5 columns
    return [(seq * attn, act, attn), (seq[:, :10] * new_attn, new_act, new_attn)]


@needs("openrlhf")
def test_openrlhf_actor_forward_matches(openrlhf_actor_class, ref_dir):
    from logprobe.integrations.openrlhf import LogprobeRefActor

    temperature = 0.9
    ours = LogprobeRefActor(str(ref_dir), temperature=temperature, device="cpu", dtype="float32", progress=False)
    # OpenRLHF loads a path only in bf16/fp16; the float32 comparison hands Actor the model instance and
    # sets the attribute its path loading sets. packing_samples=True is not run: OpenRLHF packs for
    # flash-attn's varlen kernels, and on CPU transformers' sdpa/eager attend across the packed rows.
    actor = openrlhf_actor_class(hf_model(ref_dir), temperature=temperature)
    actor.packing_samples = False
    worst = 0.0
    for sequences, action_mask, attention_mask in openrlhf_batches():
        with torch.no_grad():
            theirs = actor(sequences, action_mask, attention_mask, packed_seq_lens=None)
        got = ours(sequences, action_mask, attention_mask, packed_seq_lens=None)
        assert got.shape == theirs.shape == action_mask.shape and got.dtype == torch.float32
        assert (got[action_mask == 0] == 0).all() and (got[action_mask == 1] != 0).all()
        worst = max(worst, float((got - theirs).abs().max()))
    print(f"OpenRLHF Actor.forward: max |logprobe - OpenRLHF| = {worst:.2e}")
    assert worst <= TOL
    sequences, action_mask, attention_mask = openrlhf_batches()[0]
    cold = LogprobeRefActor(scorer=ours.scorer)(sequences, action_mask, attention_mask)  # temperature 1
    assert float((cold - ours(sequences, action_mask, attention_mask)).abs().max()) > 1e-2


@needs("verl")
@pytest.mark.slow  # slow tier (pytest -m slow): a Ray worker group
def test_verl_ray_worker_group(ref_dir):
    """LogprobeRefWorker registered the way verl's trainer builds Role.RefPolicy: two Ray workers, the
    batch split between them by verl's dispatch, answered through RayPPOTrainer._compute_ref_log_prob."""
    import types

    import ray
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    from logprobe.integrations.verl import LogprobeRefWorker

    data = verl_batch(temperature=0.8)
    expected = verl_reference(hf_model(ref_dir), data)
    config = {"model": {"path": str(ref_dir)}, "rollout": {"temperature": 1.0},
              "logprobe": {"device": "cpu", "dtype": "float32", "progress": False}}
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        pool = RayResourcePool(process_on_nodes=[2], use_gpu=False, max_colocate_count=1)
        workers = RayWorkerGroup(resource_pool=pool, device_name="cpu", ray_cls_with_init=RayClassWithInitArgs(
            cls=ray.remote(LogprobeRefWorker), config=config, role="ref"))
        workers.init_model()
        trainer = types.SimpleNamespace(ref_in_actor=False, ref_policy_wg=workers)
        got = RayPPOTrainer._compute_ref_log_prob(trainer, data).batch["ref_log_prob"]
    finally:
        if started:
            ray.shutdown()
    worst = float((got - expected).abs().max())
    print(f"verl Ray worker group (2 workers): max |logprobe - verl| = {worst:.2e}")
    assert got.shape == (4, 6) and worst <= TOL


def test_adapter_refusals(ref_dir):
    """What the adapters cannot answer exactly is an error naming it (no framework needed)."""
    from logprobe import Scorer
    from logprobe.errors import LogprobeError
    from logprobe.integrations.openrlhf import LogprobeRefActor
    from logprobe.integrations.verl import padded_layout, temperature_of

    actor = LogprobeRefActor(scorer=Scorer(str(ref_dir), device="cpu", dtype="float32", progress=False))
    seq, attn = torch.tensor([[5, 6, 7, 0]]), torch.tensor([[1, 1, 1, 0]])
    assert actor(seq, torch.tensor([[1, 1, 0]]), attn).shape == (1, 3)
    with pytest.raises(LogprobeError, match=r"response_mask\[0\]\[2\]"):  # an action on padding
        actor(seq, torch.tensor([[1, 1, 1]]), attn)
    with pytest.raises(LogprobeError, match="return_output"):
        actor(seq, torch.tensor([[1, 1, 0]]), attn, return_output=True)
    with pytest.raises(LogprobeError, match="ring_attn_group"):
        actor(seq, torch.tensor([[1, 1, 0]]), attn, ring_attn_group=object())
    with pytest.raises(LogprobeError, match="model_path"):
        LogprobeRefActor(str(ref_dir), scorer=actor.scorer)

    assert temperature_of({"temperature": torch.tensor([0.7, 0.7])}, None) == pytest.approx(0.7)
    assert temperature_of({}, 0.9) == 0.9
    with pytest.raises(LogprobeError, match="temperature"):
        temperature_of({}, None)
    with pytest.raises(LogprobeError, match="differs between rows"):
        temperature_of({"temperature": torch.tensor([0.7, 1.0])}, None)
    batch = {"input_ids": seq, "attention_mask": attn, "responses": torch.tensor([[7, 1]])}
    with pytest.raises(LogprobeError, match="responses"):
        padded_layout(batch)
    batch["responses"] = torch.tensor([[7, 0]])
    ids, mask, scored = padded_layout(batch)
    assert scored.tolist() == [[1, 0]]
