"""A copy of a tuning cache whose near-tie cuDNN winners at one batch size are given to our best Triton config, for
bench/cache_ab.py to time in a model (CPU; no GPU needed).

  python bench/cache_flip.py CACHE_DIR OUT_DIR [--batch 1] [--gpu H100] [--within 0.05] [--to triton|cudnn]

The tuner times each op alone, its weights hot in L2 from the call before. In a model, cuDNN's kernels start after
the previous kernel ends, while ours start early (PDL) and ask L2 for their weight tile before they wait
(tiles.prefetch_rows): ResNet-50 bs1's layer-3 3x3 conv took cuDNN 6.27 us alone and 7.0 in the model's timeline.
An entry flips when cuDNN won and the best Triton candidate the entry kept was within `within` of it. The flipped
entries lose their checks, so their first use checks them again. Prints each flip. --to cudnn flips the other way:
our winners to cuDNN's best candidate within `within` (in run 4 of the forty-fifth session the flip to ours cost
ResNet-50 bs1 23 us of GPU time a call, against 1.5 that the tuner's timings predicted). bench/near_ties.py flips
one entry at a time.
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


def cudnn_config(label: str) -> dict:
    """'cudnn+fold_bn:eng4_k24=29' -> {'engine': 'eng4_k24=29', 'fold_bn': True}, as the cache stores a config."""
    name, engine = label.split(":", 1)
    return {"engine": engine, "fold_bn": True} if name == "cudnn+fold_bn" else {"engine": engine}


CONFIGS = {"triton": triton_config, "cudnn": cudnn_config}


def provider(label: str) -> str:
    return label.split(":")[0].split("+")[0]


def near_ties(db, batch: int, gpu: str, within: float, to: tuple = tuple(CONFIGS)) -> list[tuple]:
    """(digest, key dict, winner's provider, its time, the label flipped to, its time) for each entry at `batch` on
    `gpu` whose winner is cuDNN's or ours and whose other provider's best candidate (among `to`) is within
    `within` of it."""
    found = []
    for digest, key, won_by, times in db.execute("SELECT digest, key, provider, times FROM entries").fetchall():
        k, times = json.loads(key), json.loads(times)
        if won_by not in CONFIGS or gpu not in k["gpu"] or k["shape"][0][0] != batch:
            continue
        won = min(times.values())
        other = sorted((t, label) for label, t in times.items() if provider(label) in set(to) - {won_by})
        if other and other[0][0] <= (1 + within) * won:
            found.append((digest, k, won_by, won, other[0][1], other[0][0]))
    return found


def flip(db, digest: str, label: str) -> None:
    """The entry `digest` given to the candidate `label`; its checks dropped, so its first use checks it again."""
    db.execute("UPDATE entries SET provider=?, config=? WHERE digest=?",
               (provider(label), json.dumps(CONFIGS[provider(label)](label), sort_keys=True), digest))
    db.execute("DELETE FROM checks WHERE digest=?", (digest,))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("cache_dir")
    p.add_argument("out_dir")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--gpu", default="H100")
    p.add_argument("--within", type=float, default=0.05)
    p.add_argument("--to", choices=tuple(CONFIGS), default="triton")
    args = p.parse_args()
    shutil.rmtree(args.out_dir, ignore_errors=True)
    shutil.copytree(args.cache_dir, args.out_dir)
    db = sqlite3.connect(f"{args.out_dir}/tuning.sqlite")
    ties = near_ties(db, args.batch, args.gpu, args.within, (args.to,))
    for digest, k, won_by, won, label, t in ties:
        flip(db, digest, label)
        print(f"{k['op']} {k['shape'][:2]} {k['epilogue']}: {won_by} {won * 1e6:.2f} us -> {t * 1e6:.2f} us "
              f"({label})")
    db.commit()
    print(f"{len(ties)} entries flipped")


if __name__ == "__main__":
    main()
