"""A copy of a tuning cache whose near-tie cuDNN winners at one batch size are given to our best Triton config, for
bench/cache_ab.py to time in a model (CPU; no GPU needed).

  python bench/cache_flip.py CACHE_DIR OUT_DIR [--batch 1] [--gpu H100] [--within 0.05]

The tuner times each op alone, its weights hot in L2 from the call before. In a model, cuDNN's kernels start after
the previous kernel ends, while ours start early (PDL) and ask L2 for their weight tile before they wait
(tiles.prefetch_rows): ResNet-50 bs1's layer-3 3x3 conv took cuDNN 6.27 us alone and 7.0 in the model's timeline.
An entry flips when cuDNN won and the best Triton candidate the entry kept was within `within` of it. The flipped
entries lose their checks, so their first use checks them again. Prints each flip.
"""
import argparse
import json
import shutil
import sqlite3


def triton_config(label: str) -> dict:
    """'triton:block_m=32,tma=False,...' -> {'block_m': 32, 'tma': False, ...}, as the cache stores a config."""
    def value(text):
        return {"True": True, "False": False}.get(text, int(text) if text.lstrip("-").isdigit() else text)
    return dict((k, value(v)) for k, v in (item.split("=") for item in label.split(":", 1)[1].split(",")))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("cache_dir")
    p.add_argument("out_dir")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--gpu", default="H100")
    p.add_argument("--within", type=float, default=0.05)
    args = p.parse_args()
    shutil.rmtree(args.out_dir, ignore_errors=True)
    shutil.copytree(args.cache_dir, args.out_dir)
    db = sqlite3.connect(f"{args.out_dir}/tuning.sqlite")
    flips = 0
    for digest, key, provider, times in db.execute("SELECT digest, key, provider, times FROM entries").fetchall():
        k, times = json.loads(key), json.loads(times)
        if provider != "cudnn" or args.gpu not in k["gpu"] or k["shape"][0][0] != args.batch:
            continue
        won = min(times.values())
        ours = sorted((t, label) for label, t in times.items() if label.startswith("triton:"))
        if not ours or ours[0][0] > (1 + args.within) * won:
            continue
        t, label = ours[0]
        db.execute("UPDATE entries SET provider='triton', config=? WHERE digest=?",
                   (json.dumps(triton_config(label), sort_keys=True), digest))
        db.execute("DELETE FROM checks WHERE digest=?", (digest,))
        flips += 1
        print(f"{k['op']} {k['shape'][:2]} {k['epilogue']}: cuDNN {won * 1e6:.2f} us -> ours {t * 1e6:.2f} us "
              f"({label})")
    db.commit()
    print(f"{flips} entries flipped")


if __name__ == "__main__":
    main()
