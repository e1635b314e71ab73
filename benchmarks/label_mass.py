"""How much of the target's next-token distribution a store's labels carry at its answer positions: whether the
label is the target's argmax, the target's probability of it, and the distribution's entropy. CE trains on the
label alone, KL on the whole distribution; the two differ by the mass off the label.

    python benchmarks/label_mass.py --store data/demo-smollm2-135m-instruct [--every 3]
"""
from __future__ import annotations

import argparse

import torch

from serving import targets
from serving.model import Model
from serving.targets import DEFAULT_TARGET
from training.data.store import Store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", required=True, help="a store folder written with layers including 'last'")
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--every", type=int, default=1, help="read every n-th example")
    args = parser.parse_args()
    store = Store(args.store)
    if "last" not in store.layers:
        raise SystemExit(f"{args.store} holds no final hidden states ('last' layer): regenerate it with "
                         "`draftheads generate --layers last`")
    lm_head = Model.from_folder(targets.resolve(args.target)).lm_head.weight.float()
    label_p, is_argmax, entropy = [], [], []
    with torch.no_grad():
        for i in range(0, len(store), args.every):
            example = store[i]
            ids, mask = example["input_ids"], example["loss_mask"]
            rows = (mask[1:] == 1).nonzero().flatten()  # position t predicts answer token t + 1
            log_p = (example["hidden"]["last"][rows].float() @ lm_head.T).log_softmax(-1)
            labels = ids[rows + 1]
            label_p.append(log_p.gather(1, labels[:, None]).exp().flatten())
            is_argmax.append((log_p.argmax(-1) == labels).float())
            entropy.append(-(log_p.exp() * log_p).sum(-1))
    label_p, is_argmax, entropy = map(torch.cat, (label_p, is_argmax, entropy))
    print(f"{len(label_p)} answer positions of {args.store}")
    print(f"label is the target's argmax: {is_argmax.mean():.3f}")
    print(f"target's probability of the label: mean {label_p.mean():.3f}, median {label_p.median():.3f}")
    for at_least in (0.5, 0.9, 0.99):
        print(f"  share of positions at >= {at_least}: {(label_p >= at_least).float().mean():.3f}")
    print(f"entropy: mean {entropy.mean():.3f} nats")


if __name__ == "__main__":
    main()
