"""Multi-head latent attention decode benchmark on CPU: `python -m tritium.client.bench.mla_bench`.

Times one layer's decode attention for B sequences at a context of L tokens, two ways, in the
same run, from the same paged latent cache:
    latent    what the engine does (backend/models/mla.py): the query's nope part projected into
              the latent space through kv_b_proj's key blocks, ops.mla_attention over the latent
              rows, the weighted latent sum mapped out through kv_b_proj's value blocks
    expanded  kv_b_proj applied to every cached latent of the sequence each step (per-head K and
              V formed), then attention per head: what a decode that does not absorb costs
and prints median milliseconds, their ratio, the relative difference of the two outputs (the
same attention, so rounding only), and the cache bytes per token per layer of the latent against
per-head K and V. `--prefill T,...`: one prompt of T tokens instead, absorbed (the engine) against
expanding its T latents once and running causal SDPA per head (what a prefill that expands does). Defaults are DeepSeek-V2-Lite's attention (16 heads, latent 512,
rope 64, nope 128, v 128).
"""
from __future__ import annotations

import argparse

import torch

from tritium.kernels import ops
from tritium.kernels.attention_metadata import AttentionMetadata
from .moe_bench import _median_ms


def _expanded(q_nope, q_pe, flat, tables, lens, w, nope, rank, scale):
    outs = []
    for b, n in enumerate(lens):
        rows = flat[tables[b][:n]]                                    # (n, rank + rope)
        kv = torch.nn.functional.linear(rows[:, :rank], w.reshape(-1, rank)).view(n, w.shape[0], -1)
        k_nope, v = kv[..., :nope], kv[..., nope:]                    # (n, H, nope), (n, H, v)
        s = (torch.einsum("hd,nhd->hn", q_nope[b], k_nope) + torch.einsum("hd,nd->hn", q_pe[b], rows[:, rank:])) * scale
        outs.append(torch.einsum("hn,nhv->hv", torch.softmax(s.float(), -1).to(v.dtype), v))
    return torch.stack(outs)


def _prefill(h, r, rope, nope, w, dtype, lengths, reps) -> None:
    """Absorbed vs expanded attention of one prompt of T tokens (all its rows)."""
    import torch.nn.functional as F
    scale = (nope + rope) ** -0.5
    print(f"{'prompt':>6} {'absorbed ms':>11} {'expanded ms':>11} {'absorbed/expanded':>17} {'rel diff':>9}")
    for t in lengths:
        nblk = -(-t // 16)
        cache = torch.randn(nblk, 16, 1, r + rope).to(dtype)
        meta = AttentionMetadata.build([t], [t], [list(range(nblk))], 16, "cpu")
        meta.cpu_plan = ops.attention_plan(meta)
        qn, qp = torch.randn(t, h, nope).to(dtype), torch.randn(t, h, rope).to(dtype)

        def absorbed():
            ql = torch.bmm(qn.transpose(0, 1), w[:, :nope]).transpose(0, 1)
            o = ops.mla_attention(torch.cat([ql, qp], -1), cache, meta, scale, r)
            return torch.bmm(o.transpose(0, 1), w[:, nope:].transpose(1, 2)).transpose(0, 1)

        def expanded():
            rows = cache.view(-1, r + rope)[:t]
            kv = F.linear(rows[:, :r], w.reshape(-1, r)).view(t, h, -1)
            k = torch.cat([kv[..., :nope], rows[:, None, r:].expand(t, h, rope)], -1)
            q = torch.cat([qn, qp], -1)
            return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), kv[..., nope:].transpose(0, 1),
                                                  is_causal=True, scale=scale).transpose(0, 1)
        with torch.inference_mode():
            a, e = _median_ms(absorbed, reps), _median_ms(expanded, reps)
            x, y = absorbed().float(), expanded().float()
        print(f"{t:>6} {a:11.1f} {e:11.1f} {a / e:17.2f} {((x - y).norm() / y.norm()).item():9.2e}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--rank", type=int, default=512)
    p.add_argument("--rope", type=int, default=64)
    p.add_argument("--nope", type=int, default=128)
    p.add_argument("--v", type=int, default=128)
    p.add_argument("--context", type=str, default="512,2048")
    p.add_argument("--batch", type=str, default="1,4")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--prefill", type=str, default=None, help="prompt lengths, e.g. 256,1024: time a prompt instead")
    a = p.parse_args(argv)
    dtype = getattr(torch, a.dtype)
    h, r, rope, nope, v = a.heads, a.rank, a.rope, a.nope, a.v
    torch.manual_seed(0)
    w = (torch.randn(h, nope + v, r) / r ** 0.5).to(dtype)
    scale = (nope + rope) ** -0.5
    elem = torch.empty((), dtype=dtype).element_size()
    print(f"{h} heads, latent {r} + rope {rope}, nope {nope}, v {v} | {a.dtype}, {torch.get_num_threads()} threads, "
          f"median of {a.reps} | cache bytes per token per layer: latent {(r + rope) * elem}, "
          f"per-head K and V {h * (nope + rope + v) * elem}")
    if a.prefill:
        _prefill(h, r, rope, nope, w, dtype, [int(x) for x in a.prefill.split(",")], a.reps)
        return 0
    print(f"{'batch':>5} {'context':>7} {'latent ms':>9} {'expanded ms':>11} {'expanded/latent':>15} {'rel diff':>9}")
    bs = 16
    for b in (int(s) for s in a.batch.split(",")):
        for ctx in (int(s) for s in a.context.split(",")):
            nblk = -(-ctx // bs)
            cache = torch.randn(b * nblk, bs, 1, r + rope).to(dtype)
            tables = [list(range(i * nblk, (i + 1) * nblk)) for i in range(b)]
            meta = AttentionMetadata.build([1] * b, [ctx] * b, tables, bs, "cpu")
            meta.cpu_plan = ops.attention_plan(meta)
            slots = [[t * bs + j for t in tab for j in range(bs)] for tab in tables]
            q_nope, q_pe = torch.randn(b, h, nope).to(dtype), torch.randn(b, h, rope).to(dtype)

            def latent():
                q_lat = torch.bmm(q_nope.transpose(0, 1), w[:, :nope]).transpose(0, 1)
                o = ops.mla_attention(torch.cat([q_lat, q_pe], -1), cache, meta, scale, r)
                return torch.bmm(o.transpose(0, 1), w[:, nope:].transpose(1, 2))
            flat = cache.view(-1, r + rope)
            with torch.inference_mode():
                lat = _median_ms(latent, a.reps)
                exp = _median_ms(lambda: _expanded(q_nope, q_pe, flat, slots, [ctx] * b, w, nope, r, scale), a.reps)
                x, y = latent().transpose(0, 1).float(), _expanded(q_nope, q_pe, flat, slots, [ctx] * b, w, nope, r,
                                                                   scale).float()
            diff = ((x - y).norm() / y.norm()).item()
            print(f"{b:>5} {ctx:>7} {lat:9.3f} {exp:11.3f} {exp / lat:15.2f} {diff:9.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
