"""The GPU path: nothing in the model, the decoding loops or the command is tied to the CPU.

The CPU tests prove the rules; these run them where a CUDA GPU is present, and are skipped, saying so,
elsewhere. On the GPU: the model against transformers in float32, float16 and bfloat16; greedy speculative
decoding (chains, trees, batches, gamma "auto" and "heuristic", prompt lookup) equal to greedy decoding in
float32, also from a prompt left on the CPU, and in half precision different only at near-ties
(benchmarks/parity_check.py's verdict); sampling with a CUDA generator reproducible and distributed as the
target (the chi-square test of test_lossless.py, shown to fail for a wrong rule); a CPU generator refused with
one line; `load_model` neither building nor attaching the C kernels; the command and two benchmarks with
`--device cuda`.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import spec_decoding.costs
import spec_decoding.loop
from benchmarks.parity_check import ParitySettings, check_parity
from gpt2 import PRESETS, GPT2Config, fast, generate, load_model
from gpt2.sampling import SamplingConfig, sample
from helpers import (
    REPO_ROOT,
    chi_square,
    chi_square_quantile_0999,
    exact_continuation_distribution,
    hub_layout,
    hub_state_dict,
    make_hf_model,
    perturbed_copy,
    tiny_gpt2,
    write_checkpoint,
)
from spec_decoding import NgramDrafter, TreeShape, Verdict, speculative_generate

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (the CPU tests cover the rules)")

CUDA = torch.device("cuda")
HALF = (torch.float16, torch.bfloat16)
DECODING = GPT2Config(n_layer=2, n_head=4, n_embd=64, n_ctx=128, vocab_size=101)  # the greedy and sampling tests
PROMPTS = [[5, 17, 3, 99, 42], [7, 7, 1], [60, 2, 33, 8, 8, 91, 14]]
MODES = {  # speculative_generate's options beside the draft
    "chain": {"gamma": 4},
    "tree": {"tree": "3,2,1"},
    "dynamic tree": {"tree": TreeShape(nodes=6, depth=3)},
    "auto": {"gamma": "auto"},
    "heuristic": {"gamma": "heuristic"},
}


@pytest.fixture(scope="module")
def models() -> dict:
    """The decoding tests' target and a noisy copy as draft (alpha ~ 0.5), on the GPU in float32."""
    target = tiny_gpt2(DECODING, seed=0)
    return {"target": target.to(CUDA), "draft": perturbed_copy(target, scale=0.04, seed=2).to(CUDA)}


@pytest.fixture(autouse=True)
def step_costs_in_tmp(tmp_path, monkeypatch):
    """gamma="auto" calibrates on the GPU into tmp_path, not the user's cache."""
    monkeypatch.setattr(spec_decoding.costs, "default_cache_dir", lambda: tmp_path / "step-costs")


def on_gpu(ids: list[int]) -> torch.Tensor:
    return torch.tensor([ids], device=CUDA)  # (1, T)


# ---------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------


@torch.inference_mode()
@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=str)
def test_the_model_matches_transformers_on_the_gpu(tmp_path, dtype):
    """gpt2's shape, loaded from a checkpoint onto the GPU: logits of 1, 5 and 60 new tokens after a 7-token
    prefill, and of the whole sequence without a cache, against transformers on the GPU. float32: max |Δ| <=
    1e-4. Half precision: our error against transformers' float32 logits at most 2x transformers' own in the
    same dtype, plus 1e-3 (both round; neither may round worse than the other)."""
    config = PRESETS["gpt2"]
    hf = make_hf_model(config, seed=1)
    folder = write_checkpoint(tmp_path / "gpt2", config, hub_state_dict(hf))
    ours = load_model(folder, device=CUDA, dtype=dtype)
    assert ours.accelerator is None and ours.device.type == "cuda" and ours.dtype == dtype
    reference = hf.to(CUDA)  # float32
    low = copy.deepcopy(hf).to(CUDA, dtype)
    for new_tokens in (1, 5, 60):
        ids = torch.randint(config.vocab_size, (1, 7 + new_tokens), generator=torch.Generator().manual_seed(new_tokens))
        ids = ids.to(CUDA)
        exact = reference(ids).logits.float()  # (1, T, V)
        cache = ours.new_cache()
        ours(ids[:, :7], cache)
        cached = ours(ids[:, 7:], cache).float()  # (1, new_tokens, V)
        uncached = ours(ids).float()
        if dtype == torch.float32:
            assert (cached - exact[:, 7:]).abs().max().item() <= 1e-4
            assert (uncached - exact).abs().max().item() <= 1e-4
        else:
            theirs = (low(ids).logits.float() - exact).abs().max().item()
            assert (cached - exact[:, 7:]).abs().max().item() <= 2 * theirs + 1e-3, theirs
            assert (uncached - exact).abs().max().item() <= 2 * theirs + 1e-3, theirs


def test_load_model_on_the_gpu_takes_the_readable_path(tmp_path):
    folder = write_checkpoint(tmp_path / "tiny", DECODING, hub_layout(tiny_gpt2(DECODING, seed=0)))
    model = load_model(folder, device="cuda")
    assert model.accelerator is None
    assert "the C kernels are for CPU float32 models, this one is cuda" in fast.status(model)
    with pytest.raises(ValueError, match="int8 weights are for the CPU in float32"):
        load_model(folder, device="cuda", quantize="int8")


# ---------------------------------------------------------------------------
# Greedy: the target's own output
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_greedy_speculative_decoding_is_greedy_decoding_on_the_gpu(models, mode):
    """float32: token for token (a near-tie would need two logits within ~1e-6, which these peaked models
    do not have), for each prompt alone and, for a chain, all three as one batch."""
    target, draft = models["target"], models["draft"]
    for ids in PROMPTS:
        out, stats = speculative_generate(target, draft, on_gpu(ids), max_new_tokens=40, **MODES[mode])
        assert out.device.type == CUDA.type
        assert torch.equal(out, generate(target, on_gpu(ids), 40)), (mode, ids)
        assert mode == "auto" or 0.0 < stats.alpha < 1.0  # drafts both kept and rejected (auto may not draft)
    if mode == "chain":
        rows, _ = speculative_generate(target, draft, PROMPTS, max_new_tokens=40, **MODES[mode])
        assert rows == generate(target, PROMPTS, 40)


@pytest.mark.parametrize("mode", ["chain", "tree", "auto"])
def test_a_prompt_on_the_cpu_for_gpu_models_comes_back_on_the_cpu_as_from_generate(models, mode):
    """As `generate` and a batch do, one sequence takes its prompt on any device (it was refused by the target's
    pass, and with gamma "auto" only after the calibration)."""
    target, draft, ids = models["target"], models["draft"], torch.tensor([PROMPTS[0]])  # (1, T) on the CPU
    out, _ = speculative_generate(target, draft, ids, max_new_tokens=20, **MODES[mode])
    baseline = generate(target, ids, 20)
    assert out.device.type == baseline.device.type == "cpu"
    assert torch.equal(out, baseline)


def test_prompt_lookup_is_greedy_decoding_on_the_gpu(models):
    target = models["target"]
    ids = on_gpu(PROMPTS[0] * 4)  # a repetitive prompt: the n-gram drafter finds matches
    out, stats = speculative_generate(target, NgramDrafter(n=3), ids, gamma=4, max_new_tokens=40)
    assert torch.equal(out, generate(target, ids, 40))
    assert stats.drafted > 0


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_half_precision_differs_only_at_near_ties(models, dtype):
    """In float16 and bfloat16 a one-row step and a (γ + 1)-row pass round differently, so the outputs may
    part at a near-tie, never elsewhere: the parity check's verdict on every prompt, and trees, batches and
    auto run and keep the prompt."""
    target, draft = (copy.deepcopy(models[role]).to(dtype) for role in ("target", "draft"))
    report = check_parity(target, draft, [(str(i), on_gpu(ids)) for i, ids in enumerate(PROMPTS)],
                          ParitySettings(gamma=4, max_new_tokens=40, eos_id=100))
    assert report.bugs == 0, report.divergences
    assert all(p.eos_ok for p in report.prompts)
    for options in ({"tree": "3,2,1"}, {"gamma": "auto"}):
        out, _ = speculative_generate(target, draft, on_gpu(PROMPTS[0]), max_new_tokens=20, **options)
        assert out.size(1) == len(PROMPTS[0]) + 20 and out[0, :5].tolist() == PROMPTS[0]
    rows, _ = speculative_generate(target, draft, PROMPTS, gamma=3, max_new_tokens=20)
    assert [row[: len(p)] for row, p in zip(rows, PROMPTS)] == PROMPTS


# ---------------------------------------------------------------------------
# Sampling with a CUDA generator
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("options", [{"gamma": 4}, {"tree": "2,2"}, {"gamma": "auto"}], ids=str)
def test_a_seed_reproduces_a_sampled_run_on_the_gpu(models, options):
    def run(seed: int):
        g = torch.Generator(CUDA).manual_seed(seed)
        out, _ = speculative_generate(models["target"], models["draft"], on_gpu(PROMPTS[0]), max_new_tokens=30,
                                      temperature=0.8, top_p=0.9, generator=g, **options)
        return out.tolist()

    assert run(1) == run(1)
    assert run(1) != run(2)  # 30 tokens from a spread distribution: two seeds differ


def test_a_batch_samples_each_row_with_its_own_gpu_generator(models):
    def run(seeds):
        gens = [torch.Generator(CUDA).manual_seed(s) for s in seeds]
        rows, _ = speculative_generate(models["target"], models["draft"], PROMPTS, gamma=3, max_new_tokens=20,
                                       temperature=1.0, generator=gens)
        return rows

    a, b = run([1, 2, 3]), run([1, 2, 9])
    assert a[:2] == b[:2] and a[2] != b[2]


@pytest.mark.parametrize("call", ["generate", "chain", "tree", "batch"])
def test_a_cpu_generator_for_a_gpu_model_is_refused(models, call):
    target, draft, cpu = models["target"], models["draft"], torch.Generator().manual_seed(0)
    runs = {
        "generate": lambda g, t: generate(target, on_gpu(PROMPTS[0]), 5, temperature=t, generator=g),
        "chain": lambda g, t: speculative_generate(target, draft, on_gpu(PROMPTS[0]), gamma=2, max_new_tokens=5,
                                                   temperature=t, generator=g),
        "tree": lambda g, t: speculative_generate(target, draft, on_gpu(PROMPTS[0]), tree="2,1", max_new_tokens=5,
                                                  temperature=t, generator=g),
        "batch": lambda g, t: speculative_generate(target, draft, PROMPTS, gamma=2, max_new_tokens=5,
                                                   temperature=t, generator=g),
    }
    with pytest.raises(ValueError, match=r"a cpu generator, but the model samples on cuda: make it there"):
        runs[call](cpu, 1.0)
    runs[call](cpu, 0.0)  # greedy draws nothing: any generator will do


# The chi-square test of test_lossless.py on the GPU: an 8-token vocabulary, the first 3 new tokens.
LOSSLESS = GPT2Config(n_layer=1, n_head=2, n_embd=16, n_ctx=16, vocab_size=8)
SAMPLE_RUNS = 4_000


def sampled_counts(target, draft, runs: int, seed: int) -> torch.Tensor:
    """Counts of the first 3 new tokens over `runs` sampled runs after the prompt [3], one CUDA generator."""
    V, counts = LOSSLESS.vocab_size, torch.zeros(LOSSLESS.vocab_size**3, dtype=torch.float64)
    g = torch.Generator(CUDA).manual_seed(seed)
    for _ in range(runs):
        out, _ = speculative_generate(target, draft, on_gpu([3]), gamma=2, max_new_tokens=3, temperature=1.0,
                                      generator=g)
        x1, x2, x3 = out[0, 1:].tolist()
        counts[(x1 * V + x2) * V + x3] += 1
    return counts


def always_accept(target_probs, draft_probs, draft_tokens, *, generator=None, uniforms=None) -> Verdict:
    """WRONG: keeps every draft, so the output follows the draft's distribution."""
    K = draft_tokens.numel()
    return Verdict(accepted=tuple(draft_tokens.tolist()), next_token=int(sample(target_probs[K], generator)))


def test_sampling_on_the_gpu_has_the_target_distribution(monkeypatch):
    """4,000 runs, Pearson's chi-square below its 0.999 quantile (a correct sampler fails with probability
    ~0.001; the seed is fixed); the same count with a rule that always accepts is far above it."""
    cpu_target = tiny_gpt2(LOSSLESS, seed=0, std=0.2)
    cpu_draft = perturbed_copy(cpu_target, scale=0.25, seed=2)
    exact = exact_continuation_distribution(cpu_target, torch.tensor([[3]]), 3, SamplingConfig(temperature=1.0))
    target, draft = copy.deepcopy(cpu_target).to(CUDA), cpu_draft.to(CUDA)

    statistic, df = chi_square(sampled_counts(target, draft, SAMPLE_RUNS, seed=0), exact)
    assert statistic < chi_square_quantile_0999(df), (statistic, df)

    monkeypatch.setattr(spec_decoding.loop, "speculative_sampling", always_accept)
    statistic, df = chi_square(sampled_counts(target, draft, SAMPLE_RUNS, seed=0), exact)
    assert statistic > 2 * chi_square_quantile_0999(df), (statistic, df)


# ---------------------------------------------------------------------------
# The command and the benchmarks with --device cuda
# ---------------------------------------------------------------------------

COMMAND_MODEL = GPT2Config(n_layer=2, n_head=2, n_embd=32, n_ctx=128)  # the real vocabulary, for the tokenizer


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("cuda_models")
    target = tiny_gpt2(COMMAND_MODEL, seed=0)
    draft = perturbed_copy(target, scale=0.005, seed=1)
    return {name: write_checkpoint(root / name, COMMAND_MODEL, hub_layout(model), with_tokenizer=True)
            for name, model in (("target", target), ("draft", draft))}


def command(tmp_path, folders, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "spec_decoding_generate.py"), "--draft", str(folders["draft"]),
         "--target", str(folders["target"]), "--weights-dir", str(tmp_path / "weights"), "--device", CUDA.type,
         "--no-color", "--prompt", "The lighthouse keeper", "--max-gen", "24", *args],
        cwd=tmp_path, capture_output=True, text=True, encoding="utf-8", timeout=300,
        env={**{k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE"))},
             "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home"), "PYTHONIOENCODING": "utf-8"},
    )


@pytest.mark.parametrize("args", [
    ["--compare"], ["--dtype", "float16", "--compare"], ["--dtype", "bfloat16", "--tree", "2,2", "--compare"],
    ["--gamma", "auto", "--compare"], ["--draft-quantize", "int8"],
], ids=" ".join)
def test_the_command_runs_on_the_gpu(tmp_path, folders, args):
    done = command(tmp_path, folders, *args)
    if "int8" in args:  # int8 is for the CPU: one line, exit 2
        assert done.returncode == 2 and "Traceback" not in done.stderr and "error: " in done.stderr, done.stderr
        return
    assert done.returncode == 0, done.stderr
    # Rehearsed untimed first: the first run at each sequence length pays the GPU's one-time costs (float16 on an
    # H200: 8 tokens/s reported, and --compare's speedup 0.48x against 0.01x predicted).
    assert "warming up the cuda device: the run once, untimed and not shown" in done.stderr, done.stderr
    dtype = "float32" if "--dtype" not in args else args[args.index("--dtype") + 1]
    assert re.search(rf"{CUDA.type}(:\d+)? {dtype}", done.stdout), done.stdout
    if "--dtype" not in args:  # float32: the target alone, token for token
        assert "identical to the target alone" in done.stdout, done.stdout


def test_the_command_samples_reproducibly_on_the_gpu(tmp_path, folders):
    runs = [json.loads(command(tmp_path, folders, "--temperature", "0.9", "--seed", seed, "--json").stdout)
            for seed in ("4", "4", "5")]
    assert runs[0]["token_ids"] == runs[1]["token_ids"] != runs[2]["token_ids"]


def test_the_benchmarks_run_on_the_gpu(tmp_path):
    for module, args in [
        ("parity_check", ["--tiny", "--dtypes", "float32,bfloat16,float16", "--prompts", "2", "--max-gen", "12"]),
        ("gamma_sweep", ["--tiny", "--gamma", "1", "3", "--max-gen", "12", "--prompts", "2", "--repeats", "1",
                         "--component-calls", "2", "--simulate-acceptance", "0.7", "--tree", "2,1",
                         "--no-progress"]),
    ]:
        done = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", "--device", CUDA.type, *args,
                               "--out", str(tmp_path / module)], cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, (module, done.stderr[-2000:])
        assert f"device: {CUDA.type}" in done.stdout, done.stdout[:2000]
