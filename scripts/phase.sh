# Sourced by .ci/run and scripts/test: `phase NAME COMMAND...` runs COMMAND and appends NAME, its
# seconds and ok/failed to the file $TRAILMARK_PHASE_TIMES names (when set; .ci/run sets it and
# prints the lines at its end). COMMAND's exit code is phase's own.
#
# COMMAND runs as the condition of `||`, where bash ignores `set -e`: give it scripts and
# programs, or shell functions that check each step themselves.
phase() {
  local name=$1 t0=$EPOCHREALTIME rc=0
  shift
  "$@" || rc=$?
  if [ -n "${TRAILMARK_PHASE_TIMES:-}" ]; then
    local outcome=ok
    [ "$rc" -eq 0 ] || outcome="failed ($rc)"
    printf '%s\t%s\t%s\n' "$name" "$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.0f", b - a }')" \
      "$outcome" >>"$TRAILMARK_PHASE_TIMES"
  fi
  return "$rc"
}

# The lines $TRAILMARK_PHASE_TIMES holds, as a table with their sum.
phase_summary() {
  [ -s "${TRAILMARK_PHASE_TIMES:-}" ] || return 0
  echo "phase times (seconds):"
  awk -F'\t' '{ printf "  %-42s %6d  %s\n", $1, $2, $3; if ($1 !~ /beside/) total += $2 }
    END { printf "  %-42s %6d\n", "total (phases run beside others not added)", total }' "$TRAILMARK_PHASE_TIMES"
}
