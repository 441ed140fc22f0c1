# Sourced by the tools/gpu_*_run.sh scripts: find_gpu_libs LIB... puts the folder of each
# shared library that ldconfig does not know on LD_LIBRARY_PATH (binaries built on the dev
# machine, run on the GPU machine), and exports it.
add_lib_dir() {
  case ":${LD_LIBRARY_PATH:-}:" in *":$1:"*) ;; *) LD_LIBRARY_PATH="$1${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;; esac
}
find_gpu_libs() {
  local lib f
  for lib in "$@"; do
    if ! ldconfig -p 2>/dev/null | grep -q "$lib"; then
      for f in /usr/local/cuda/lib64/$lib /usr/local/cuda/lib/$lib \
               $(find /usr /opt -name "$lib" -not -path '*/proc/*' 2>/dev/null | head -3); do
        if [ -e "$f" ]; then add_lib_dir "$(dirname "$f")"; break; fi
      done
    fi
  done
  export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}"
}
