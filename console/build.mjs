// Bundles the console into the Python package's static folder (one script, one stylesheet, the
// page): `npm ci && npm run build`, or `make console`. The output is committed, so that the
// package serves the console without Node; tests/test_console.py checks it matches these sources.
import { build } from "esbuild";
import { createHash } from "node:crypto";
import { copyFileSync, readdirSync, readFileSync, statSync, writeFileSync } from "node:fs";
import { gzipSync } from "node:zlib";
import { join } from "node:path";

const OUT = "../src/tandem/deployments/console_static";

function sourceFiles(dir) {
  return readdirSync(dir)
    .sort()
    .flatMap((name) => {
      const path = join(dir, name);
      return statSync(path).isDirectory() ? sourceFiles(path) : [path];
    });
}

// What the bundle was built from: the same digest is recomputed by the tests.
export function sourceDigest() {
  const hash = createHash("sha256");
  for (const path of [...sourceFiles("src"), "index.html", "package-lock.json"]) {
    hash.update(path + "\0");
    hash.update(readFileSync(path));
    hash.update("\0");
  }
  return hash.digest("hex");
}

await build({
  entryPoints: { console: "src/main.js" },
  bundle: true,
  minify: true,
  format: "esm",
  target: ["chrome110", "firefox110", "safari16"],
  outdir: OUT,
  legalComments: "eof",
  logLevel: "info",
});
await build({
  entryPoints: { console: "src/console.css" },
  bundle: true,
  minify: true,
  outdir: OUT,
  logLevel: "info",
});
copyFileSync("index.html", join(OUT, "index.html"));
copyFileSync("node_modules/uplot/LICENSE", join(OUT, "uPlot.LICENSE.txt")); // MIT: its notice ships with it
// Precompressed copies, which the server sends to browsers that accept gzip.
for (const name of ["console.js", "console.css"]) {
  writeFileSync(join(OUT, `${name}.gz`), gzipSync(readFileSync(join(OUT, name)), { level: 9 }));
}
writeFileSync(join(OUT, "SOURCE_DIGEST"), sourceDigest() + "\n");
