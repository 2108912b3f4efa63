#!/bin/bash
# device (one H200): GPT-2 XL, 2 ranks on GPU 0 as 2 emulated nodes, the shipped SpCCL config (CONFIG: another) for its
# 100 iterations, once per entry of VARIANTS ("name:override,override;name2:..."; "shipped:" for none).
# Each run's log and iterations.csv go into $OUT/runs.tgz (remade after each run); $OUT/losses.txt has one line per run
# (loss at iteration 100, mean of the last 10, speed figures from the summary); with output.calls=true in an entry,
# its calls.csv goes into the tarball too.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
SPCCL_NO_BUILD_EXT=1 python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /tmp/install.log 2>&1 || cat /tmp/install.log
rm -rf /tmp/vruns && mkdir -p /tmp/vruns/runs  # a warm machine keeps /tmp: this call's runs only
IFS=';' read -ra list <<< "${VARIANTS:-shipped:}"
for entry in "${list[@]}"; do
  name=${entry%%:*}
  IFS=',' read -ra extra <<< "${entry#*:}"
  start=$SECONDS
  CUDA_VISIBLE_DEVICES=0 NPROC=2 launch/torchrun.sh --emulate-nodes 2 "configs/${CONFIG:-gpt2_xl_spccl.yaml}" model.n_layer=48 \
    "${extra[@]}" output.dir=/tmp/runs output.name="$name" output.progress=false output.plot=false > "/tmp/vruns/runs/$name.log" 2>&1
  rc=$?
  cp "/tmp/runs/$name/iterations.csv" "/tmp/vruns/runs/$name.csv" 2>/dev/null
  cp "/tmp/runs/$name/calls.csv" "/tmp/vruns/runs/$name.calls.csv" 2>/dev/null  # with output.calls=true
  python3 - "/tmp/vruns/runs/$name.csv" "$name" "$rc" "$((SECONDS - start))" >> "$OUT/losses.txt" <<'PY'
import csv, sys
path, name, rc, secs = sys.argv[1:]
try:
    rows = list(csv.DictReader(open(path)))
    loss = [float(r["loss"]) for r in rows]
    it = sorted(float(r["time_s"]) for r in rows[20:])
    norms = [float(r["grad_norm"]) for r in rows]
    spikes = [i for i in range(20, len(loss)) if loss[i] > loss[i - 1] + 0.3]
    sent = sum(float(r["bytes_sent"]) for r in rows[20:]) / max(1.0, sum(float(r["dense_bytes"]) for r in rows[20:]))
    ran = sorted({c for r in rows[20:] for c in r.get("choices", "").split()})
    print(f"{name}: rc {rc}, {secs} s; loss@100 {loss[99]:.3f}, last10 {sum(loss[90:]) / 10:.3f}; "
          f"median iteration {it[len(it) // 2] * 1e3:.1f} ms; max grad norm after 20 {max(norms[20:]):.2f}; spikes {spikes}; "
          f"bytes {100 * sent:.2f}% (iterations 20-99); choices seen after 20 {' '.join(ran)[:200]}")
except Exception as e:
    print(f"{name}: rc {rc}, {secs} s; no iterations ({e})")
PY
  tail -1 "$OUT/losses.txt"
  tar czf "$OUT/runs.tgz" -C /tmp/vruns runs  # kept whole after each run
done
