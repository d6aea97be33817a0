"""The GPU benchmarks' machine-readable file and the step breakdown's kernel categories."""

import json

import pytest

from benchmarks.results_file import update
from benchmarks.train_step import category


def test_each_benchmark_replaces_its_own_key_and_keeps_the_others(tmp_path):
    path = tmp_path / "results" / "gpu.json"
    update(path, "attention", [{"T": 4096, "ours_fwd_ms": 1.0}], "GPU A")
    update(path, "step", [{"T": 4096, "step_s": 0.2}], "GPU A")
    update(path, "attention", [{"T": 8192, "ours_fwd_ms": 2.0}], "GPU B")
    data = json.loads(path.read_text())
    assert data == {"device": "GPU B", "attention": [{"T": 8192, "ours_fwd_ms": 2.0}],
                    "step": [{"T": 4096, "step_s": 0.2}]}
    assert [p.name for p in path.parent.iterdir()] == ["gpu.json"]  # no temporary file left beside it


def test_a_damaged_results_file_is_named_not_overwritten(tmp_path):
    path = tmp_path / "gpu.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="gpu.json is not JSON"):
        update(path, "step", [], "GPU")
    assert path.read_text() == "{not json"


@pytest.mark.parametrize("kernel,part", [
    ("_fwd_kernel", "gated attention"), ("_dkdv_kernel", "gated attention"), ("_delta_kernel", "gated attention"),
    ("_cap_bwd", "capacity"), ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>", "sdpa attention"),
    ("cudnn_generated_fort_native_sdpa_sm90", "sdpa attention"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmuls"), ("nvjet_tst_128x64_64x6", "matmuls"),
    ("void at::native::vectorized_elementwise_kernel<4, ...>", "other"),
])
def test_step_kernels_fall_into_their_parts(kernel, part):
    assert category(kernel) == part
