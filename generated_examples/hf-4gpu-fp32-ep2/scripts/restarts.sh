# Sourced by the launch scripts (not a command): the checks of their variables, what a launch passes to its
# ranks, and its restart policy.

# refuse MESSAGE: the launch stops with one line and exit code 2 (a mistake in the input), before anything starts.
refuse() {
  echo "$(basename "$0"): error: $1" >&2
  exit 2
}

# require_count NAME LOW HIGH EXAMPLE: the variable NAME holds a whole number from LOW to HIGH (digits only, so
# that bash arithmetic never reads it as an expression or a variable name), or the launch stops here. The
# variable is then written in decimal (08 -> 8: bash would read a leading 0 as octal).
require_count() {
  local name="$1" low="$2" high="$3" value="${!1}"
  if [[ ! "$value" =~ ^[0-9]{1,9}$ ]] || (( 10#$value < low || 10#$value > high )); then
    refuse "$name must be a whole number from $low to $high, got ${value@Q}; e.g. $name=$4"
  fi
  printf -v "$name" '%d' "$((10#$value))"
}

# require_choice NAME CHOICE...: the variable NAME holds one of the choices, or the launch stops here.
require_choice() {
  local name="$1" value="${!1}" choice
  shift
  for choice in "$@"; do
    if [[ "$value" == "$choice" ]]; then return 0; fi
  done
  refuse "$name must be one of $*, got ${value@Q}; e.g. $name=$1"
}

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
# mistake in the input: the ranks' file in TRAIN_USAGE_ERRORS tells a usage error (exit code 2, at once) from a
# crash (torchrun exits with 1 for any failed rank) and from a finished run.
train_with_restarts() {
  local max_restarts="$1" restarts=0 status
  shift
  # Ctrl-C reaches torchrun too, which stops the ranks: then end here, instead of restarting them.
  trap 'exit 130' INT
  while true; do
    status=0
    "$@" || status=$?
    # First the mark: ranks that stopped on a mistake in the input exit with 0 after leaving it (errors.stop), so
    # that torchrun reports nothing; the one line they printed is all the user sees.
    if [[ -e "$TRAIN_USAGE_ERRORS/usage-error" ]]; then return 2; fi
    if (( status == 0 )); then return 0; fi
    if (( restarts >= max_restarts )); then return "$status"; fi
    restarts=$((restarts + 1))
    echo "$(basename "$0"): training failed (exit code $status); restart $restarts of $max_restarts, from the newest checkpoint" >&2
  done
}
