"""tf.data pipelines from the manifest's TFRecord shards to `(uint8 images, int32 labels)` batches.

Training: interleaved readers -> (cache) -> shuffle with the seed -> repeat -> GLOBAL batches -> parse
the whole batch -> batched random crop + flip -> prefetch. Evaluation: the same reader, every example
once. Normalization is the model's first layer (`cifar.models`), not done here.
"""

from __future__ import annotations

from pathlib import Path

import tensorflow as tf

from cifar.data.manifest import IMAGE_SHAPE, Manifest, load_manifest

PAD_PIXELS = 4  # Pad-and-crop shift for 32x32 models (the ResNet paper's augmentation).
JITTER_SEED_SALT = 1  # Derives the colour jitter's seeds from a batch's (seed, step), apart from the crops'.
FEATURES = {"image": tf.io.FixedLenFeature([], tf.string), "label": tf.io.FixedLenFeature([], tf.int64)}


def per_replica_batch_size(global_batch_size: int, num_replicas: int) -> int:
    """The batch each replica computes; the global batch must split evenly."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if global_batch_size % num_replicas:
        raise ValueError(
            f"batch_size {global_batch_size} is the global batch and must be divisible by the {num_replicas} replicas"
        )
    return global_batch_size // num_replicas


def parse_batch(serialized: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """A batch of serialized examples -> uint8 images (B, 32, 32, 3) and int32 labels (B,)."""
    features = tf.io.parse_example(serialized, FEATURES)
    pixels = tf.io.decode_raw(features["image"], tf.uint8)  # (B, 3072)
    images = tf.reshape(pixels, [-1, *IMAGE_SHAPE])  # (B, 32, 32, 3)
    return images, tf.cast(features["label"], tf.int32)


def random_crop_flip(
    images: tf.Tensor,
    size: int,
    pad: int,
    seed: tf.Tensor,
    *,
    padding_mode: str = "zeros",
    flips: tf.Tensor | None = None,
) -> tf.Tensor:
    """Batched augmentation: pad by `pad`, take a random `size` crop per image, flip half.

    `seed` is a stateless seed (shape (2,)), so the same seed gives the same crops and flips.
    `padding_mode` is "zeros" (the ResNet paper) or "reflect" (airbench). `flips` (B,) int32 0/1
    gives the flips instead of drawing them (see `alternating_flips`).
    """
    if padding_mode not in ("zeros", "reflect"):
        raise ValueError(f"padding_mode must be 'zeros' or 'reflect', got {padding_mode!r}")
    if pad:
        mode = "CONSTANT" if padding_mode == "zeros" else "REFLECT"
        images = tf.pad(images, [[0, 0], [pad, pad], [pad, pad], [0, 0]], mode=mode)
    batch = tf.shape(images)[0]
    max_offset = tf.shape(images)[1] - size
    seeds = tf.random.experimental.stateless_split(seed, 3)
    row_offsets = tf.random.stateless_uniform([batch, 1], seeds[0], 0, max_offset + 1, dtype=tf.int32)
    column_offsets = tf.random.stateless_uniform([batch, 1], seeds[1], 0, max_offset + 1, dtype=tf.int32)
    if flips is None:
        flips = tf.random.stateless_uniform([batch, 1], seeds[2], 0, 2, dtype=tf.int32)
    else:
        flips = tf.reshape(tf.cast(flips, tf.int32), [batch, 1])
    steps = tf.range(size, dtype=tf.int32)[None, :]  # (1, size)
    rows = row_offsets + steps  # (B, size)
    # A flipped image reads its columns right to left.
    columns = column_offsets + tf.where(flips == 1, size - 1 - steps, steps)  # (B, size)
    # Per-example crops by index grids: rows, then columns.
    images = tf.gather(images, rows, axis=1, batch_dims=1)  # (B, size, W0, C)
    return tf.gather(images, columns, axis=2, batch_dims=1)  # (B, size, size, C)


def color_jitter(
    images: tf.Tensor, seed: tf.Tensor, *, mean: list[float], std: list[float], brightness: float, contrast: float
) -> tf.Tensor:
    """Random brightness and contrast per image (the hiverge CIFAR-10 record's jitter), uint8 in and out.

    In the model's normalised units x = (pixel / 255 - mean) / std, each image becomes
    (x + b) * c with b ~ U(-brightness, brightness) and c ~ U(1 - contrast, 1 + contrast): a shift
    of up to `brightness` standard deviations, then a stretch away from (or toward) the channel
    mean. Back on the 0..255 scale the result is rounded and clipped, which only touches pixels
    already near black or white. `seed` is a stateless seed (shape (2,)).
    """
    batch = tf.shape(images)[0]
    seeds = tf.random.experimental.stateless_split(seed, 2)
    shifts = tf.random.stateless_uniform([batch, 1, 1, 1], seeds[0], -brightness, brightness)
    scales = tf.random.stateless_uniform([batch, 1, 1, 1], seeds[1], 1.0 - contrast, 1.0 + contrast)
    centre = 255.0 * tf.constant(mean, tf.float32)  # (3,): the channel means in pixel levels.
    spread = 255.0 * tf.constant(std, tf.float32)
    pixels = centre + (tf.cast(images, tf.float32) - centre + shifts * spread) * scales
    return tf.cast(tf.clip_by_value(tf.round(pixels), 0.0, 255.0), tf.uint8)


def alternating_flips(serialized: tf.Tensor, seed: int, epoch: tf.Tensor) -> tf.Tensor:
    """airbench's alternating flip: (B,) int32, 1 = mirror this example in this epoch.

    Each example gets a fixed random bit (a keyed hash of its record, so it needs no example id
    and is the same in every epoch and on every worker) and is mirrored when that bit differs from
    the epoch's parity: every image is seen both ways round in any two consecutive epochs, instead
    of by chance.
    """
    key = [seed & 0xFFFFFFFF, 0x5EED]
    bits = tf.cast(tf.strings.to_hash_bucket_strong(serialized, 2, key=key), tf.int32)
    parity = tf.cast(tf.math.floormod(epoch, 2), tf.int32)
    return tf.bitwise.bitwise_xor(bits, parity)


def center_crop(images, size: int):
    """The central `size` x `size` window of (N, H, W, C) images, numpy arrays or tensors alike."""
    height, width = int(images.shape[1]), int(images.shape[2])
    if size > height or size > width:
        raise ValueError(f"crop size {size} exceeds the image size {height}x{width}")
    top, left = (height - size) // 2, (width - size) // 2
    return images[:, top : top + size, left : left + size, :]


def _records(paths: list[str], *, deterministic: bool, shuffle_files_seed: int | None) -> tf.data.Dataset:
    if not paths:
        raise ValueError("no shard files to read: the split is empty")
    files = tf.data.Dataset.from_tensor_slices(paths)
    if shuffle_files_seed is not None:
        files = files.shuffle(len(paths), seed=shuffle_files_seed)
    return files.interleave(
        tf.data.TFRecordDataset,
        cycle_length=min(len(paths), 8),
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=deterministic,
    )


# Batches the training pipeline prepares ahead of the model (a fixed number: see `_options`).
TRAIN_PREFETCH_BATCHES = 2


def _options(deterministic: bool, autotune: bool = True) -> tf.data.Options:
    """Determinism, element-wise sharding and, for training, no tf.data autotuning.

    The autotuner's thread sleeps between optimization rounds that grow to 60 s apart, and
    destroying an iterator waits for it: after a training run's last step, `model.fit` sat up to
    50 s in `RootDataset::Iterator::~Iterator` with the process idle. Training therefore runs with
    the autotuner off; AUTOTUNE parallelism then starts (and stays) at the number of cores, and the
    prefetch depth is fixed. The input pipeline costs ~2 % of an epoch, so nothing is lost to tuning.
    """
    options = tf.data.Options()
    options.deterministic = deterministic
    options.autotune.enabled = autotune
    # Element-wise sharding across workers: correct for any number of shard files.
    # Across workers, by element: never duplicates or drops an example whatever the number of shard files,
    # provided every worker sees the same order (the pipeline is deterministic for multi-worker runs).
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return options


def split_paths(manifest: Manifest, data_dir: str | Path, splits: list[str]) -> list[str]:
    """Absolute shard paths of the named splits, in manifest order."""
    return [path for split in splits for path in manifest.shard_paths(data_dir, split)]


def split_size(manifest: Manifest, splits: list[str]) -> int:
    return sum(manifest.splits[split].num_examples for split in splits if split in manifest.splits)


def make_train_dataset(
    data_dir: str | Path,
    *,
    splits: list[str],
    batch_size: int,
    image_size: int,
    seed: int,
    augment: bool = True,
    cache: bool = True,
    shuffle_buffer: int = 10_000,
    deterministic: bool = False,
    start_step: int = 0,
    crop_padding: int | None = None,
    padding_mode: str = "zeros",
    flip: str = "random",
    steps_per_epoch: int | None = None,
    brightness_jitter: float = 0.0,
    contrast_jitter: float = 0.0,
) -> tf.data.Dataset:
    """An endless stream of shuffled, augmented GLOBAL batches from the training splits.

    `start_step` offsets the per-batch augmentation seeds and the shuffle seed so a resumed run
    does not replay the first epochs' crops and order. `crop_padding` (None = `PAD_PIXELS` for
    32x32 inputs, 0 for smaller crops) and `padding_mode` set the random translation; `flip` is
    "random", "alternating" (needs `steps_per_epoch` to know the epoch of a step) or "none".
    `brightness_jitter` and `contrast_jitter` (0 = off) are `color_jitter`'s ranges, in standard
    deviations of the training pixels and as a fraction.
    """
    if flip not in ("random", "alternating", "none"):
        raise ValueError(f"flip must be 'random', 'alternating' or 'none', got {flip!r}")
    if flip == "alternating" and not steps_per_epoch:
        raise ValueError("alternating flips need steps_per_epoch")
    manifest = load_manifest(data_dir)
    paths = split_paths(manifest, data_dir, splits)
    pad = (PAD_PIXELS if image_size == IMAGE_SHAPE[0] else 0) if crop_padding is None else crop_padding
    jitter = {"mean": manifest.mean, "std": manifest.std, "brightness": brightness_jitter, "contrast": contrast_jitter}
    shuffle_seed = seed + 1_000_003 * start_step
    dataset = _records(paths, deterministic=deterministic, shuffle_files_seed=shuffle_seed)
    if cache:
        dataset = dataset.cache()  # Serialized records: ~3 KB each, parsed per batch below.
    dataset = dataset.shuffle(shuffle_buffer, seed=shuffle_seed, reshuffle_each_iteration=True).repeat()
    # Batched before parsing (drop_remainder: every step has the same shape): one `parse_example` and one
    # `decode_raw` per step instead of one per image, and the augmentation is a single gather per batch.
    dataset = dataset.batch(batch_size, drop_remainder=True)
    # Pair every batch with its step number: the augmentation seed is (seed, step), stateless.
    dataset = tf.data.Dataset.zip(dataset, tf.data.Dataset.counter(start_step))
    options = {"padding_mode": padding_mode, "flip": flip, "steps_per_epoch": steps_per_epoch, "jitter": jitter}
    transform = _batch_transform(seed, image_size, pad, augment=augment, **options)
    dataset = dataset.map(transform, num_parallel_calls=tf.data.AUTOTUNE, deterministic=deterministic)
    return dataset.prefetch(TRAIN_PREFETCH_BATCHES).with_options(_options(deterministic, autotune=False))


def _batch_transform(
    seed: int,
    image_size: int,
    pad: int,
    *,
    augment: bool,
    padding_mode: str,
    flip: str,
    steps_per_epoch: int | None,
    jitter: dict,
):
    """(serialized batch, step) -> (images, labels): parsed, then cropped, flipped and jittered when `augment`."""

    def parse_and_augment(serialized, step):
        images, labels = parse_batch(serialized)
        if augment:
            batch_seed = tf.stack([tf.cast(seed, tf.int64), step])
            flips = None
            if flip == "alternating":
                flips = alternating_flips(serialized, seed, step // steps_per_epoch)
            elif flip == "none":
                flips = tf.zeros_like(labels)
            images = random_crop_flip(images, image_size, pad, batch_seed, padding_mode=padding_mode, flips=flips)
            if jitter["brightness"] or jitter["contrast"]:
                jitter_seed = tf.random.experimental.stateless_fold_in(batch_seed, JITTER_SEED_SALT)
                images = color_jitter(images, jitter_seed, **jitter)
        elif image_size != IMAGE_SHAPE[0]:
            images = center_crop(images, image_size)
        return images, labels

    return parse_and_augment


def make_eval_dataset(
    data_dir: str | Path, *, splits: list[str], batch_size: int, image_size: int, cache: bool = False
) -> tf.data.Dataset:
    """Every example of the splits exactly once, in file order, in batches (the last may be short)."""
    manifest = load_manifest(data_dir)
    dataset = _records(split_paths(manifest, data_dir, splits), deterministic=True, shuffle_files_seed=None)
    if cache:
        dataset = dataset.cache()
    dataset = dataset.batch(batch_size, drop_remainder=False)

    def parse_and_crop(serialized):
        images, labels = parse_batch(serialized)
        if image_size != IMAGE_SHAPE[0]:
            images = center_crop(images, image_size)
        return images, labels

    dataset = dataset.map(parse_and_crop, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    # TFRecord readers hide the size; stating it lets Keras know the number of steps up front.
    num_batches = -(-split_size(manifest, splits) // batch_size)
    dataset = dataset.apply(tf.data.experimental.assert_cardinality(num_batches))
    return dataset.prefetch(tf.data.AUTOTUNE).with_options(_options(True))
