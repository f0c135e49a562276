"""Run documented Python examples in this one process, as tests/test_doc_examples.py extracted them.

argv: examples.json results.json. Each example runs in a namespace of its own (named ``__main__``, as a script)
and a fresh working directory under the current one; an example marked ``continues`` runs in the namespace and
directory of the one before it. The code is compiled under the name of its Markdown file, shifted to its line
there, so a traceback names the documentation file and line. Writes ``{example id: None or traceback}``.
"""

import gc
import json
import os
import sys
import traceback


def main() -> None:
    with open(sys.argv[1]) as f:
        examples = json.load(f)
    base = os.getcwd()
    results: dict[str, str | None] = {}
    namespace: dict = {}
    for number, example in enumerate(examples):
        if not example["continues"]:
            namespace = {"__name__": "__main__"}
            gc.collect()  # the previous example's datasets (and their caches) go now
            workdir = os.path.join(base, f"example{number}")
            os.makedirs(workdir)
        os.chdir(workdir)
        print(f"--- {example['id']}", flush=True)
        try:
            code = compile("\n" * example["fence_line"] + example["code"], example["file"], "exec")
            exec(code, namespace)
            results[example["id"]] = None
        except BaseException:  # SystemExit and KeyboardInterrupt too: the example failed, not this runner
            results[example["id"]] = traceback.format_exc()
    with open(os.path.join(base, sys.argv[2]), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
