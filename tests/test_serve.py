"""examples/serve.py on CPU: the HTTP service answers like the model, bad requests get a 4xx and leave
it serving; the exported program (planned for an H100) carries symbolic batch and sequence."""
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import serve  # noqa: E402
from strategies import force_stitching  # noqa: E402


def test_service_answers_and_rejects_bad_requests():
    c = serve.QUICK
    state, infer = serve.make_infer(c)
    service = serve.Service("jax.jit", state, serve.jit_runner(infer), bucket=True)
    server = serve.serve(service, c)
    port = server.server_address[1]
    try:
        for what, body, want in serve.bad_requests(c):
            status, reply = serve.post(port, body)
            assert status == want and "error" in reply, what
        tokens = np.random.default_rng(0).integers(1, c.vocab, (3, 11))
        tokens[:, 9:] = 0
        status, reply = serve.post(port, json.dumps({"tokens": tokens.tolist()}).encode())
        assert status == 200
        want = jax.jit(infer)(state, jnp.asarray(tokens, jnp.int32))
        np.testing.assert_allclose(reply["scores"], want, rtol=2e-3, atol=2e-3)  # (GPU matmuls: TF32)
        assert list(service.compiled) == [(4, 64)]  # bucketed; padding changes no score
        assert serve.post(port, b"[]")[0] == 400
    finally:
        server.shutdown()


def test_export_for_serving_is_symbolic_and_stitched():
    """The masked-LM head's log-softmax over the vocabulary is a family kernel in the exported program
    (at the full model's 30522 tokens the cost model picks it; see README); on CPU the same program
    runs the region through XLA, at any batch and length."""
    c = serve.QUICK
    state, infer = serve.make_infer(c)
    with force_stitching():  # (at this tiny vocabulary the cost model would leave the head to XLA)
        exported, compile_for = serve.export_runner(infer, state, c, target="h100", platforms=("cpu", "cuda"))
    tokens = exported.in_avals[-1]
    assert not all(isinstance(d, int) for d in tokens.shape), tokens.shape
    assert exported.mlir_module().count("@jaxstitch_launch(") >= 1  # (forced: layer norms, GELU, the head)
    for batch, seq in ((1, 5), (3, 17)):
        t = np.random.default_rng(batch).integers(1, c.vocab, (batch, seq)).astype(np.int32)
        np.testing.assert_allclose(compile_for(state, t)(state, t), jax.jit(infer)(state, t), rtol=1e-5, atol=1e-5)
