set -u; W=/tmp/g; mkdir -p $W/hf $W/resume
nvidia-smi -L; python3 -c "import torch,triton,transformers;print(torch.__version__,triton.__version__,transformers.__version__)"
WORK=$W/dist OUT=$W/dist TAIL=4 bash benchmarks/run_distributed_gpu.sh tests 2>&1 | tail -20
export PYTHONPATH=/tmp/site:$PWD/src:$PWD
timeout 100 torchrun --standalone --nproc-per-node 2 benchmarks/gpu_hf_tp_plan.py --out $W/hf > $W/hf/log.txt 2>&1; echo "hf rc=$?"; tail -15 $W/hf/log.txt
timeout 230 bash benchmarks/gpu_resume.sh $W/resume > $W/resume/log.txt 2>&1; echo "resume rc=$?"; tail -25 $W/resume/log.txt
cp $W/hf/*.md $W/resume/*.md $OUT/ 2>/dev/null; tar czf $OUT/gpu_session8.tgz -C $W --exclude='*.distcp' --exclude='*.pt' . ; ls -la $OUT
