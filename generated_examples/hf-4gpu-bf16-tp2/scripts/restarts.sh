# Sourced by the launch scripts (not a command): what a launch passes to its ranks, and its restart policy.

# start_launch ID FOLDER: export, for every rank of this launch,
# - TRAIN_LAUNCH_ID=ID: run.json records it, and a restart continues the run in job.output_dir only if this
#   launch started it (preflight.py), whatever restart counters the environment holds;
# - TRAIN_USAGE_ERRORS=FOLDER: a rank that stops on a mistake in the input leaves a file there (errors.stop).
start_launch() {
  export TRAIN_LAUNCH_ID="$1" TRAIN_USAGE_ERRORS="$2"
  mkdir -p "$TRAIN_USAGE_ERRORS"
  rm -f "$TRAIN_USAGE_ERRORS/usage-error"
}

# watch_this_script: every rank on this host exits as soon as this script is gone, killed too (ownership.py),
# so that nothing goes on training unseen. Its pid, and its start time (field 22 of /proc/PID/stat), which tells
# it from a later process that reuses the pid.
watch_this_script() {
  [[ -r "/proc/$$/stat" ]] || return 0  # not Linux: the ranks stop with torchrun only
  local stat fields
  stat="$(< "/proc/$$/stat")"
  read -r -a fields <<< "${stat##*) }"  # the fields after "PID (COMMAND) ", from field 3
  export TRAIN_LAUNCHER="$HOSTNAME:$$:${fields[19]}"
}

# train_with_restarts MAX COMMAND...: run COMMAND (one attempt: a torchrun with --max-restarts 0) and, after a
# failure, run it again, up to MAX times; each attempt resumes from the newest complete checkpoint. Never after a
# mistake in the input: torchrun exits with 1 for any failed rank, so the ranks' file in TRAIN_USAGE_ERRORS
# tells a usage error (exit code 2, at once) from a crash.
train_with_restarts() {
  local max_restarts="$1" restarts=0 status
  shift
  # Ctrl-C reaches torchrun too, which stops the ranks: then end here, instead of restarting them.
  trap 'exit 130' INT
  while true; do
    status=0
    "$@" || status=$?
    if (( status == 0 )); then return 0; fi
    if [[ -e "$TRAIN_USAGE_ERRORS/usage-error" ]]; then return 2; fi
    if (( restarts >= max_restarts )); then return "$status"; fi
    restarts=$((restarts + 1))
    echo "$(basename "$0"): training failed (exit code $status); restart $restarts of $max_restarts, from the newest checkpoint" >&2
  done
}
