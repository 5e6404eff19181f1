"""Serve a Flax transformer encoder over HTTP, under jax.jit and under jaxstitch, and load it.

    python examples/serve.py            # both compilers, a bounded load on loopback, a table last
    python examples/serve.py --quick    # a tiny model (CPU-friendly)

Requests are POST /infer with JSON {"tokens": [[int, ...], ...]} (batch x sequence, 0 pads); the
reply holds each row's score (the mean log-probability of its tokens under the masked-LM head). Batch and sequence length change from request to request.
`jax.jit` compiles the model for each new shape. jaxstitch exports it once at start-up with
symbolic batch and sequence (`jax.export`, kernels planned and compiled then), so a new shape costs
only XLA's compile of the exported program: no planning, no NVRTC. `--bucket` pads the batch to a
power of two and the sequence to a multiple of 64 (fewer shapes for both). Bad requests (not JSON, wrong rank, empty, not integers,
oversized, out-of-vocabulary) get a 4xx and leave the service as it was.

Printed: p50 / p99 latency and throughput per compiler, time to the first result of never-seen
shapes, and, once, jaxstitch's cold planning + codegen + NVRTC time against XLA's compile time.
"""
from __future__ import annotations

import argparse
import dataclasses
import http.server
import json
import threading
import time
import urllib.error
import urllib.request

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxstitch

MAX_BATCH = 64


@dataclasses.dataclass(frozen=True)
class Config:
    layers: int = 6
    hidden: int = 768
    heads: int = 12
    mlp: int = 3072
    vocab: int = 30522
    max_seq: int = 512


QUICK = Config(layers=2, hidden=128, heads=4, mlp=512, vocab=1000, max_seq=128)


class Layer(nnx.Module):
    def __init__(self, c: Config, rngs: nnx.Rngs):
        self.attn = nnx.MultiHeadAttention(c.heads, c.hidden, decode=False, rngs=rngs)
        self.ln1 = nnx.LayerNorm(c.hidden, rngs=rngs)
        self.up = nnx.Linear(c.hidden, c.mlp, rngs=rngs)
        self.down = nnx.Linear(c.mlp, c.hidden, rngs=rngs)
        self.ln2 = nnx.LayerNorm(c.hidden, rngs=rngs)

    def __call__(self, x, mask):
        x = self.ln1(x + self.attn(x, mask=mask))
        return self.ln2(x + self.down(jax.nn.gelu(self.up(x))))


class Encoder(nnx.Module):
    """A BERT-style encoder with its masked-LM head (tied to the token embedding) that scores each
    sequence: the mean log-probability the model gives each of its tokens (pseudo-likelihood, as
    rerankers and filters use it)."""

    def __init__(self, c: Config, rngs: nnx.Rngs):
        self.tok = nnx.Embed(c.vocab, c.hidden, rngs=rngs)
        self.pos = nnx.Embed(c.max_seq, c.hidden, rngs=rngs)
        self.ln = nnx.LayerNorm(c.hidden, rngs=rngs)
        self.layers = nnx.List([Layer(c, rngs) for _ in range(c.layers)])
        self.out = nnx.LayerNorm(c.hidden, rngs=rngs)

    def __call__(self, tokens):
        keep = tokens != 0
        x = self.ln(self.tok(tokens) + self.pos(jnp.arange(tokens.shape[1]))[None])
        mask = nnx.make_attention_mask(keep, keep)
        for layer in self.layers:
            x = layer(x, mask)
        logits = self.tok.attend(self.out(x))                       # [batch, seq, vocab]
        # log p(token) per position: a log-softmax over the vocabulary and a pick of the token's
        # entry, written as a masked row sum so that it stays one memory-bound region
        picked = jnp.arange(logits.shape[-1]) == tokens[..., None]
        logp = jnp.sum(jnp.where(picked, jax.nn.log_softmax(logits, axis=-1), 0.0), axis=-1)
        return jnp.sum(logp * keep, axis=1) / jnp.maximum(jnp.sum(keep, axis=1), 1)


def make_infer(c: Config):
    """(state, infer): the model's weights and a pure function infer(state, tokens) -> scores."""
    graphdef, state = nnx.split(Encoder(c, nnx.Rngs(0)))
    return state, lambda st, tokens: nnx.merge(graphdef, st)(tokens)


class BadRequest(ValueError):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def parse_tokens(body: bytes, c: Config) -> np.ndarray:
    """The request's tokens as int32 [batch, seq], or BadRequest saying what is wrong."""
    try:
        tokens = json.loads(body)["tokens"]
    except (ValueError, KeyError, TypeError):
        raise BadRequest(400, 'the body must be JSON {"tokens": [[int, ...], ...]}') from None
    if not isinstance(tokens, list) or not tokens or not all(isinstance(r, list) for r in tokens):
        raise BadRequest(400, "tokens must be a non-empty list of rows (rank 2)")
    if len({len(r) for r in tokens}) != 1 or not tokens[0]:
        raise BadRequest(400, "tokens: every row must have the same, non-zero length")
    if not all(isinstance(t, int) and not isinstance(t, bool) for r in tokens for t in r):
        raise BadRequest(400, "tokens must be integers")
    if len(tokens) > MAX_BATCH or len(tokens[0]) > c.max_seq:
        raise BadRequest(413, f"at most {MAX_BATCH} rows of {c.max_seq} tokens")
    arr = np.asarray(tokens, np.int64)
    if arr.min() < 0 or arr.max() >= c.vocab:
        raise BadRequest(400, f"token ids must lie in [0, {c.vocab})")
    return arr.astype(np.int32)


class Service:
    """One model behind a lock (one GPU); remembers which shapes it has compiled and how long the
    first result of each took."""

    def __init__(self, name: str, state, runner, bucket: bool):
        self.name, self.state, self.runner, self.bucket = name, state, runner, bucket
        self.lock = threading.Lock()
        self.compiled: dict[tuple[int, int], object] = {}
        self.first_result: dict[tuple[int, int], float] = {}

    def __call__(self, tokens: np.ndarray) -> tuple[np.ndarray, bool]:
        """The scores, and whether this request's (bucketed) shape was new."""
        n = tokens.shape[0]
        if self.bucket:  # pad rows to a power of two and the sequence to a multiple of 64
            batch, seq = 1 << (tokens.shape[0] - 1).bit_length(), -(-tokens.shape[1] // 64) * 64
            tokens = np.pad(tokens, ((0, batch - tokens.shape[0]), (0, seq - tokens.shape[1])))
        with self.lock:
            t0 = time.perf_counter()
            fn = self.compiled.get(tokens.shape)
            new = fn is None
            if new:
                fn = self.compiled[tokens.shape] = self.runner(self.state, tokens)
            out = np.asarray(fn(self.state, tokens))
            if new:
                self.first_result[tokens.shape] = time.perf_counter() - t0
        return out[:n], new


def jit_runner(infer):
    """jax.jit: trace and compile for each new shape."""
    def compile_for(state, tokens):
        return jax.jit(infer).lower(state, tokens).compile()
    return compile_for


def export_runner(infer, state, c: Config, target=None, platforms=("cuda",)):
    """jaxstitch: export once with symbolic batch and sequence; per new shape, XLA's compile of the
    exported program only."""
    b, s = jax.export.symbolic_shape("b, s")
    specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
    exported = jax.export.export(jaxstitch.jit(infer, target=target), platforms=list(platforms),
                                 disabled_checks=jaxstitch.disabled_checks())(specs, jax.ShapeDtypeStruct((b, s), jnp.int32))

    def compile_for(state, tokens):
        return jax.jit(exported.call).lower(state, tokens).compile()
    return exported, compile_for


class Handler(http.server.BaseHTTPRequestHandler):
    service: Service
    config: Config

    def do_POST(self):
        if self.path != "/infer":
            return self._reply(404, {"error": "POST /infer"})
        try:
            length = int(self.headers.get("Content-Length", "0"))
            if length > 4 * MAX_BATCH * self.config.max_seq * 8:
                raise BadRequest(413, "request body too large")
            scores, new = self.service(parse_tokens(self.rfile.read(length), self.config))
        except BadRequest as e:
            return self._reply(e.status, {"error": str(e)})
        self._reply(200, {"scores": [round(float(v), 6) for v in scores], "new_shape": new})

    def _reply(self, status: int, body: dict):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):  # quiet
        pass


def serve(service: Service, c: Config) -> http.server.ThreadingHTTPServer:
    handler = type("BoundHandler", (Handler,), {"service": service, "config": c})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def post(port: int, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/infer", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def bad_requests(c: Config) -> list[tuple[str, bytes, int]]:
    return [("not JSON", b"{nope", 400), ("rank 1", json.dumps({"tokens": [1, 2, 3]}).encode(), 400),
            ("empty", json.dumps({"tokens": []}).encode(), 400),
            ("floats", json.dumps({"tokens": [[1.5, 2.0]]}).encode(), 400),
            ("ragged", json.dumps({"tokens": [[1, 2], [3]]}).encode(), 400),
            ("oversized", json.dumps({"tokens": [[1] * (c.max_seq + 1)]}).encode(), 413),
            ("out of vocabulary", json.dumps({"tokens": [[c.vocab]]}).encode(), 400)]


def load(port: int, c: Config, requests: int, seconds: float, seed: int) -> dict:
    """Requests one after another (bounded in count and time) with random batch and length."""
    rng = np.random.default_rng(seed)
    latencies, new, t_start = [], [], time.perf_counter()
    for _ in range(requests):
        if time.perf_counter() - t_start > seconds:
            break
        batch, seq = int(rng.integers(1, 17)), int(rng.integers(8, c.max_seq // 2 + 1))
        tokens = rng.integers(1, c.vocab, (batch, seq))
        tokens[:, seq - int(rng.integers(0, seq // 2)):] = 0  # padding
        t0 = time.perf_counter()
        status, body = post(port, json.dumps({"tokens": tokens.tolist()}).encode())
        latencies.append(time.perf_counter() - t0)
        assert status == 200 and len(body["scores"]) == batch, (status, body)
        new.append(body["new_shape"])
    return {"latencies": np.array(latencies), "new": np.array(new, bool), "seconds": time.perf_counter() - t_start}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a tiny model")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--seconds", type=float, default=120.0, help="stop each load after this long")
    p.add_argument("--bucket", action="store_true", help="pad batch to a power of two, sequence to a multiple of 64")
    p.add_argument("--target", help="plan for this GPU (on a machine without one, jaxstitch runs as XLA)")
    p.add_argument("--cold-only", action="store_true", help="measure the cold start only, serve nothing")
    args = p.parse_args()
    c = QUICK if args.quick else Config()
    state, infer = make_infer(c)
    gpu = jaxstitch.targets.detect() is not None
    if not gpu and args.target is None:
        print("no CUDA GPU here: jaxstitch would be jax.jit; planning for an H100 to show the export")
        args.target = "h100"

    # Cold start: jaxstitch's own work for the model (tracing at the sample sizes, partitioning,
    # planning, codegen, NVRTC) against XLA's compile of it for one shape. A trivial program runs
    # first so that neither side pays the backend's one-time start.
    jax.block_until_ready(jax.jit(lambda x: x + 1)(jnp.ones(8)))
    example = jnp.ones((8, 128 if not args.quick else 32), jnp.int32)
    before, built = jaxstitch.cache_stats(), jaxstitch.build_stats()
    t0 = time.perf_counter()
    exported, stitched_compile = export_runner(infer, state, c, args.target)
    t_export = time.perf_counter() - t0
    nvrtc = jaxstitch.cache_stats().nvrtc_compiles - before.nvrtc_compiles
    t_nvrtc = jaxstitch.cache_stats().nvrtc_seconds - before.nvrtc_seconds
    t_ours = jaxstitch.build_stats().seconds - built.seconds
    t0 = time.perf_counter()
    lowered = jax.jit(infer).lower(state, example)
    t_lower = time.perf_counter() - t0
    t0 = time.perf_counter()
    lowered.compile()
    t_xla = time.perf_counter() - t0
    print(f"jaxstitch's own work for the model (its trace with symbolic sizes, plans at two sample sizes, codegen, "
          f"{nvrtc} NVRTC compiles in {t_nvrtc:.2f} s): {t_ours:.2f} s = {100 * t_ours / t_xla:.0f}% of "
          f"XLA's compile of the model for one shape ({t_xla:.2f} s; tracing and lowering before it "
          f"{t_lower:.2f} s). The whole jax.export with symbolic batch and sequence: {t_export:.2f} s")
    print(f"stitched kernel calls in the exported program: {exported.mlir_module().count('@jaxstitch_launch(')}")
    if not gpu or args.cold_only:
        print("no GPU: not serving the exported program (it is for platform cuda)" if not gpu else "--cold-only: done")
        return

    rows = []
    for name, runner in (("jax.jit", jit_runner(infer)), ("jaxstitch", stitched_compile)):
        service = Service(name, state, runner, args.bucket)
        server = serve(service, c)
        port = server.server_address[1]
        for what, body, want in bad_requests(c):
            status, reply = post(port, body)
            assert status == want, (what, status, reply)
        result = load(port, c, args.requests, args.seconds, seed=0)
        for what, body, want in bad_requests(c)[:2]:  # still answers properly afterwards
            assert post(port, body)[0] == want
        server.shutdown()
        lat, new = result["latencies"] * 1e3, result["new"]
        first, warm = lat[new], lat[~new]

        def pct(a, q):
            return f"{np.percentile(a, q):.1f}" if len(a) else "-"
        rows.append((name, len(lat), int(new.sum()), pct(first, 50), pct(warm, 50), pct(warm, 99),
                     pct(lat, 50), pct(lat, 99), f"{len(lat) / result['seconds']:.2f}"))
        print(f"{name}: {len(lat)} requests, {int(new.sum())} of new shapes, bad requests answered 4xx")
    print(f"\n{jax.devices()[0].device_kind}, {time.strftime('%Y-%m-%d')}, bucketing {'on' if args.bucket else 'off'}")
    print("| compiler | requests | new shapes | first result p50 ms | warm p50 ms | warm p99 ms | all p50 ms "
          "| all p99 ms | requests/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print("| " + " | ".join(str(v) for v in row) + " |")


if __name__ == "__main__":
    main()
