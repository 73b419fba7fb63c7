# Sourced by the GPU machine's check scripts: `step LOG COMMAND...` runs COMMAND, appends the command,
# its output and its wall time to $out/LOG.txt (and the terminal), and remembers a failure in $status.
status=0
step() {
  local log="$out/$1.txt"
  shift
  echo "== $*" | tee -a "$log"
  local begin=$SECONDS
  "$@" 2>&1 | tee -a "$log"
  status=$(( status || PIPESTATUS[0] ))
  echo "wall $(( SECONDS - begin )) s" | tee -a "$log"
}
