set -u
STAGES= bash scripts/gpu_run.sh >/dev/null 2>&1
export PYTHONPATH=src:/tmp/site:.whl/stub
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
export RAGDOT_FAILURES=$OUT/f.txt
timeout 200 env XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 python3 -m pytest -m gpu -n 2 -q -p no:cacheprovider tests/test_gpu.py -k "w8a16 and not 32768" > $OUT/tests_a.log 2>&1; echo "tests_a rc $?"; tail -3 $OUT/tests_a.log
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py -k "w8a16 and 32768" > $OUT/tests_b.log 2>&1; echo "tests_b rc $?"; tail -3 $OUT/tests_b.log
timeout 170 python3 scripts/fp8_layouts.py $OUT/decode --shapes decode --only "qwen3-30b gate_up decode" "qwen3-30b down decode" --rounds 3 \
  --variant nk:6,128,0 --variant nk:8,128,0 --variant kn:6,128,2 --variant kn:7,128,2 --variant kn:8,128,1 --variant kn:8,64,2 > $OUT/layouts.log 2>&1; echo "layouts rc $?"; grep -v "^WARNING\|^I0000\|^E0000" $OUT/layouts.log | tail -4
timeout 90 python3 scripts/fp8_layouts.py $OUT/train --only "qwen3-30b gate_up" --rounds 3 > $OUT/layouts_train.log 2>&1; echo "train rc $?"; grep -v "^WARNING\|^I0000\|^E0000" $OUT/layouts_train.log | tail -3
