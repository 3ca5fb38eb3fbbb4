#!/bin/bash
# Shell functions for the launchers: the hosts GPUHealthMonitor found faulty, from <checkpoint dirpath>/exclude_hosts.txt
# (one host a line, '#' comments). Sourced by recipes/slurm/*.sbatch and recipes/torchrun-multinode.sh; tested by
# tests/test_gpu_health.py on a fixture file.

# recipe_checkpoint_dir RECIPE: the first `dirpath:` of the recipe (FaultTolerantCheckpoint's folder), as written.
recipe_checkpoint_dir() {
    sed -n 's/^[[:space:]]*dirpath:[[:space:]]*\([^[:space:]#]*\).*/\1/p' "$1" | sed -n 1p
}

# exclude_hosts_list FILE: its hosts, comma-separated, each once, in file order; nothing when the file is absent.
# A line that is not a host name (letters, digits, '.', '_', '-') is skipped with a warning on stderr.
exclude_hosts_list() {
    [ -f "$1" ] || return 0
    awk '{ line = $0; sub(/#.*/, ""); gsub(/[ \t\r]/, "") }
         $0 == "" { next }
         $0 !~ /^[A-Za-z0-9._-]+$/ { printf "exclude_hosts: ignoring %s line %d: %s\n", FILENAME, FNR, line > "/dev/stderr"; next }
         !seen[$0]++ { out = out (out == "" ? "" : ",") $0 }
         END { if (out != "") print out }' "$1"
}

# hosts_in_list HOSTS LIST: the HOSTS (newline- or comma-separated) that LIST (comma-separated) holds, comma-separated.
hosts_in_list() {
    local host out=""
    for host in ${1//,/ }; do
        case ",$2," in *",$host,"*) out="${out:+$out,}$host" ;; esac
    done
    echo "$out"
}
