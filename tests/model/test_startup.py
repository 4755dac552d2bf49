"""What loading a model costs beyond reading its weights: nothing that a user waits for at every
start-up without getting anything from it."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_loading_a_model_imports_no_compiler_stack(tiny_model_dir):
    """Building the model on the meta device and loading it (rope tables included, whose variants
    differ: llama3 and longrope's extra table) runs no op on meta tensors that would import torch's
    compiler stack (torch._dynamo, whose import is slow) at every start-up."""
    script = textwrap.dedent(
        f"""
        import sys, torch
        from minisgl_backend.model.loader import load_model
        from minisgl_backend.model.rope import RopeSpec, Rotary
        load_model({str(tiny_model_dir)!r}, "bfloat16", "cpu")
        with torch.device("meta"):
            for spec in (
                RopeSpec(head_dim=16, theta=5e5, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                         high_freq_factor=4.0, original_max_position_embeddings=64),
                RopeSpec(head_dim=16, theta=1e4, rope_type="longrope", short_factor=(1.0,) * 8,
                         long_factor=(2.0,) * 8, original_max_position_embeddings=64,
                         max_position_embeddings=256),
            ):
                rotary = Rotary(spec)
        assert rotary.inv_freq.is_meta and rotary.long_inv_freq.shape == (8,)
        print("torch._dynamo" in sys.modules)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False", "loading imported torch._dynamo"
