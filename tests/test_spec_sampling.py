"""Speculative sampling keeps the target's distribution exactly (Leviathan et al. 2023, Chen et al.
2023), and these tests can tell when it does not: each runs the real rule and deliberately broken
ones, and a chi-square test must accept the real rule and reject every broken one.

- The rule alone on small synthetic distributions, with a draft distribution q and with the
  n-gram proposer's point mass: the first emitted token must follow p.
- The whole engine over many seeds: a tiny Llama target with a different tiny Llama as its draft
  (the same random weights at a smaller scale, so q differs from p), temperature 1 and top-k 3; the joint distribution of the generated
  tokens 2 and 3 (both produced by verification) against the exact one computed from the
  Hugging Face model (the oracle), with top-k applied as the sampler does.
"""
from typing import List

import pytest
import torch

from tritium.backend.engine import LLMEngine
from tritium.backend.sampler import draw
from tritium.backend.sampling_params import SamplingParams
from tritium.backend.speculative.config import SpeculativeConfig
from tritium.backend.speculative.verify import speculative_sampling, uniform

pytestmark = pytest.mark.usefixtures("one_thread")


def accept_always(p, proposal, q, gen) -> List[int]:
    """Broken: takes every proposed token (the output follows the proposer, not the target)."""
    return list(proposal) + [draw(p[len(proposal)], gen)]


def resample_from_p(p, proposal, q, gen) -> List[int]:
    """Broken: the right acceptance test, but a rejection resamples from p, not norm(max(0, p - q))."""
    for j, x in enumerate(proposal):
        qx = 1.0 if q is None else float(q[j, x])
        if uniform(gen) * qx < float(p[j, x]):
            continue
        return list(proposal[:j]) + [draw(p[j], gen)]
    return list(proposal) + [draw(p[len(proposal)], gen)]


def always_reject(p, proposal, q, gen) -> List[int]:
    """Broken: rejects everything and emits a sample of the residual."""
    residual = p[0] - (q[0] if q is not None else torch.nn.functional.one_hot(
        torch.tensor(proposal[0]), p.shape[1]).float())
    return [draw(residual.clamp_min(0), gen)]


RULES = {"leviathan": speculative_sampling, "accept_always": accept_always,
         "resample_from_p": resample_from_p, "always_reject": always_reject}


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit; cells expected below 5 are pooled into one."""
    n = counts.sum()
    expected = probs.double() * n
    small = expected < 5
    obs = torch.cat([counts.double()[~small], counts.double()[small].sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(exp) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.double),
                                         torch.tensor(stat / 2.0, dtype=torch.double)))


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("proposer", ["draft_q", "point_mass"])
def test_rule_alone_keeps_the_target_distribution(rule, proposer):
    torch.manual_seed(0)
    vocab, n = 8, 20000
    p = torch.softmax(torch.randn(3, vocab) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(2, vocab) * 1.5, dim=-1)
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(vocab)
    for _ in range(n):
        if proposer == "draft_q":
            proposal = [draw(q[0], gen), draw(q[1], gen)]
            tokens = RULES[rule](p, proposal, q, gen)
        else:  # the n-gram lookup proposes the same tokens every time: q is a point mass
            tokens = RULES[rule](p, [3, 5], None, gen)
        counts[tokens[0]] += 1
    pval = chi_square_pvalue(counts, p[0])
    if rule == "leviathan":
        assert pval > 1e-3, pval
    else:
        assert pval < 1e-6, pval


@pytest.fixture(scope="module")
def target_and_draft(tiny_engine, tiny_checkpoint):
    import tempfile

    from tritium.builder.build import BuildOptions, build_engine
    draft = tempfile.mkdtemp() + "/engine"
    # The same random model with its weights drawn at a smaller scale: a related but different q.
    build_engine(BuildOptions(source=tiny_checkpoint("llama", init_std=0.1), output=draft, dtype="float32",
                              progress=False))
    return tiny_engine("llama"), draft, tiny_checkpoint("llama")


PROMPT = [17, 230, 45, 600, 81]
TOP_K = 3


def exact_joint_of_tokens_2_3(checkpoint) -> torch.Tensor:
    """P(t2, t3) = sum over t1 of p(t1) p(t2 | t1) p(t3 | t1, t2), each top-k-truncated, from HF."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()

    def dist(ids):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        vals, idx = logits.topk(TOP_K)
        return idx.tolist(), torch.softmax(vals, dim=-1).tolist()

    joint = {}
    t1s, p1 = dist(PROMPT)
    for a, pa in zip(t1s, p1):
        t2s, p2 = dist(PROMPT + [a])
        for b, pb in zip(t2s, p2):
            t3s, p3 = dist(PROMPT + [a, b])
            for c, pc in zip(t3s, p3):
                joint[(b, c)] = joint.get((b, c), 0.0) + pa * pb * pc
    return joint


@pytest.mark.parametrize("rule", ["leviathan", "accept_always", "resample_from_p"])
def test_engine_sampling_over_seeds_matches_the_target(target_and_draft, rule):
    target, draft, checkpoint = target_and_draft
    engine = LLMEngine(target, device="cpu", num_kv_blocks=512, max_num_seqs=128,
                       speculative=SpeculativeConfig("draft", num_speculative_tokens=2, draft_engine_dir=draft,
                                                     step_overhead_tokens=float("inf")))
    engine.speculator.rule = RULES[rule]
    num = 2400
    params = [SamplingParams(max_tokens=4, temperature=1.0, top_k=TOP_K, seed=s, ignore_eos=True) for s in range(num)]
    outs = []
    for i in range(0, num, 400):
        outs += engine.generate(prompt_token_ids=[PROMPT] * 400, params=params[i:i + 400])
    st = engine.stats()
    # Tokens 2 and 3 came from verifying 2-token proposals, some accepted, some not.
    assert st["spec_verify_rows"] >= num and st["spec_accepted_tokens"] > 0
    assert rule == "accept_always" or st["spec_accepted_tokens"] < 0.9 * st["spec_proposed_tokens"]
    joint = exact_joint_of_tokens_2_3(checkpoint)
    cells = sorted(joint)
    index = {c: i for i, c in enumerate(cells)}
    counts = torch.zeros(len(cells) + 1)  # the last cell: pairs outside top-k (impossible for the target)
    for out in outs:
        t = out.outputs[0].token_ids
        counts[index.get((t[1], t[2]), len(cells))] += 1
    probs = torch.tensor([joint[c] for c in cells] + [0.0])
    if counts[-1] > 0:
        pval = 0.0  # a pair the target can never produce
    else:
        pval = chi_square_pvalue(counts[:-1], probs[:-1])
    if rule == "leviathan":
        assert pval > 1e-3, (pval, counts.tolist(), probs.tolist())
    else:
        assert pval < 1e-6, pval
