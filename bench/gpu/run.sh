#!/usr/bin/env bash
# Every GPU figure of moeguard in one run (issue #42). From the repository root on a fresh
# H100/H200 machine:
#
#   bench/gpu/run.sh                 # install what is missing, measure every part, <= 8 min
#   bench/gpu/run.sh --dry           # the same code on CPU, tiny sizes, no installs (CI runs it)
#   bench/gpu/run.sh --only torchtitan,acting
#
# Writes $OUT/gpu.json (every figure, and what each part could not do and why), $OUT/gpu.md (the
# "GPU" section for docs/BENCHMARKS.md) and $OUT/run.log; OUT defaults to ./gpu-out.
# The whole script is one function, read before it runs: an edit of this file during a run
# cannot change the run.
main() {
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT="$PWD"

usage() {
  cat <<'EOF'
usage: bench/gpu/run.sh [--dry] [--only PART[,PART...]] [--no-install]

Every GPU figure of moeguard in one command, each part time-boxed (`timeout`) so the whole run
ends within 8 minutes on one H100/H200. Run it from the repository root; results go to $OUT
(default ./gpu-out): gpu.json, gpu.md (the "GPU" section for docs/BENCHMARKS.md) and run.log.
A part that fails or runs out of its box is recorded as such in gpu.json (with what it finished
and the tail of its log); the other parts still run.

install (box 45 s, skipped by --dry and --no-install): the checkout is put on PYTHONPATH (no
  build needed); wheels in ./.whl (made here by bench/gpu/wheels.sh, for a machine that reaches
  no package registry) are installed into /tmp/moeguard-site; else pip installs the project's
  collector extra and transformers 5.23.0 / accelerate 1.15.0 / torchtitan 0.3.0 (the pins of
  scripts/test), and a CUDA torch wheel only when the installed torch has no CUDA. What is
  importable afterwards is recorded in gpu.json "install".

parts (box on a GPU; --dry box):
EOF
  "${PYTHON:-python3}" -m bench.gpu.common help 2>/dev/null || echo "  (python3 could not list them: see bench/gpu/common.py)"
  cat <<'EOF'

options:
  --dry          CPU only (CUDA_VISIBLE_DEVICES=""), tiny sizes, the current Python ($PYTHON or
                 python3), no installs: proves the script; its figures mean nothing
  --only LIST    run only these parts (comma-separated)
  --no-install   skip the install step (the current environment has everything)
  -h, --help     this help

environment: OUT (results folder), PYTHON (interpreter, default python3), MOEGUARD_COMMIT (the
  commit gpu.json names, where the machine has no git: MOEGUARD_COMMIT=$(git rev-parse --short HEAD)
  written into the command here).
EOF
}

DRY=""
ONLY=""
INSTALL=1
while [ $# -gt 0 ]; do
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --dry) DRY="--dry"; INSTALL=0 ;;
    --no-install) INSTALL=0 ;;
    --only)
      [ $# -ge 2 ] || { echo "bench/gpu/run.sh: --only needs a list of parts" >&2; exit 2; }
      ONLY="$2"; shift ;;
    --only=*) ONLY="${1#--only=}" ;;
    *) echo "bench/gpu/run.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done

PY="${PYTHON:-python3}"
OUT="${OUT:-$ROOT/gpu-out}"
mkdir -p "$OUT" || { echo "bench/gpu/run.sh: cannot create OUT '$OUT'" >&2; exit 2; }
OUT="$(cd "$OUT" && pwd)"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/moeguard-gpu-XXXXXX")"
LOG="$OUT/run.log"
: >"$LOG"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
[ -n "$DRY" ] && export CUDA_VISIBLE_DEVICES=""
say() { echo "[gpu-bench $(date -u +%H:%M:%S)] $*" | tee -a "$LOG"; }

PARTS="$("$PY" -c 'from bench.gpu.common import PART_NAMES; print(" ".join(PART_NAMES))')" || {
  echo "bench/gpu/run.sh: $PY cannot import bench.gpu.common (run from a checkout)" >&2
  exit 2
}
if [ -n "$ONLY" ]; then
  for p in ${ONLY//,/ }; do
    case " $PARTS " in *" $p "*) ;; *) echo "bench/gpu/run.sh: --only '$p': one of $PARTS" >&2; exit 2 ;; esac
  done
  PARTS="${ONLY//,/ }"
fi

# ---- install -------------------------------------------------------------------------------
install() {
  local t0=$SECONDS status="ok" how=""
  if compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
    how="wheels from .whl/"
    timeout 40 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/moeguard-site "$ROOT"/.whl/*.whl >>"$LOG" 2>&1 || status="failed: pip from .whl/ (run.log)"
    export PYTHONPATH="$ROOT:/tmp/moeguard-site${PYTHONPATH#"$ROOT"}"
  else
    how="pip from the registry"
    timeout 35 "$PY" -m pip install -q --retries 0 --timeout 5 -e "$ROOT[collector]" \
      "transformers==5.23.0" "accelerate==1.15.0" "torchtitan==0.3.0" >>"$LOG" 2>&1 ||
      status="failed: pip install (no registry reachable? run bench/gpu/wheels.sh where one is, carry .whl)"
    if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null &&
      command -v nvidia-smi >/dev/null; then
      how="$how; CUDA torch"
      timeout $((45 - (SECONDS - t0) > 5 ? 45 - (SECONDS - t0) : 5)) "$PY" -m pip install -q --retries 0 \
        --timeout 5 torch --index-url https://download.pytorch.org/whl/cu128 >>"$LOG" 2>&1 ||
        status="$status; failed: CUDA torch wheel"
    fi
  fi
  local report
  report="$("$PY" -m bench.gpu.common 2>>"$LOG" || echo '{}')"
  printf '{"status": "%s", "how": "%s", "took_s": %d, "imports": %s}\n' \
    "$status" "$how" $((SECONDS - t0)) "$report" >"$WORK/install.json"
  say "install: $status ($how, $((SECONDS - t0)) s)"
}
if [ "$INSTALL" = 1 ]; then
  install
else
  why="--no-install"
  [ -n "$DRY" ] && why="--dry"
  printf '{"status": "skipped (%s)", "imports": %s}\n' "$why" \
    "$("$PY" -m bench.gpu.common 2>>"$LOG" || echo '{}')" >"$WORK/install.json"
fi

# ---- the parts -------------------------------------------------------------------------------
for p in $PARTS; do
  box="$("$PY" -c "from bench.gpu.common import part; q = part('$p'); print(q.dry_box_s if '$DRY' else q.box_s)")"
  say "part $p (box $box s) ..."
  t0=$(date +%s.%N)
  timeout -k 5 "$box" "$PY" -m bench.gpu.parts "$p" --work "$WORK" $DRY >"$WORK/$p.log" 2>&1
  rc=$?
  took=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  echo "$rc $took" >"$WORK/$p.rc"
  { echo "----- $p (exit $rc, $took s)"; tail -c 20000 "$WORK/$p.log"; } >>"$LOG"
  say "part $p: exit $rc after $took s"
done

"$PY" -m bench.gpu.report --work "$WORK" --out "$OUT" $DRY >>"$LOG" 2>&1 || {
  say "the report failed (run.log); part files kept in $WORK"
  exit 1
}
say "wrote $OUT/gpu.json and $OUT/gpu.md"
cat "$OUT/gpu.md"
rm -rf "$WORK"
}

main "$@"
