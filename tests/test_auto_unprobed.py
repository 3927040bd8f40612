"""Parallel("auto") on a model it cannot measure: a GAN (no call of its own), an unbuilt model, a refused probe.

Such a model trains data-parallel, which needs no measurement, and explain() says why (issue 31, item 3).
"""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

from paraml import Parallel, estimate_memory
from paraml.auto import decide

LATENT = 4


class GAN(keras.Model):
    """The Keras guide's GAN ("Customizing what happens in fit()"), its trackers made in __init__, tiny."""

    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.seed_generator = keras.random.SeedGenerator(1337)
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def train_step(self, real_images):
        batch_size = ops.shape(real_images)[0]
        latent = keras.random.normal((batch_size, self.latent_dim), seed=self.seed_generator)
        combined = ops.concatenate([self.generator(latent), real_images], axis=0)
        labels = ops.concatenate([ops.ones((batch_size, 1)), ops.zeros((batch_size, 1))], axis=0)
        labels += 0.05 * keras.random.uniform(ops.shape(labels), seed=self.seed_generator)  # the guide's noise, seeded
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(combined))
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
        latent = keras.random.normal((batch_size, self.latent_dim), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(ops.zeros((batch_size, 1)), self.discriminator(self.generator(latent)))
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


def make_gan() -> keras.Model:
    discriminator = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(4, 3, strides=2, padding="same"),
            keras.layers.LeakyReLU(negative_slope=0.2),
            keras.layers.GlobalMaxPooling2D(),
            keras.layers.Dense(1),
        ],
        name="discriminator",
    )
    generator = keras.Sequential(
        [
            keras.Input((LATENT,)),
            keras.layers.Dense(4 * 4 * 4),
            keras.layers.LeakyReLU(negative_slope=0.2),
            keras.layers.Reshape((4, 4, 4)),
            keras.layers.Conv2DTranspose(4, 4, strides=2, padding="same"),
            keras.layers.LeakyReLU(negative_slope=0.2),
            keras.layers.Conv2D(1, 3, padding="same", activation="sigmoid"),
        ],
        name="generator",
    )
    return GAN(discriminator, generator, latent_dim=LATENT)  # not built: it has no call, as in the guide


def gan_compile() -> dict:
    return {
        "d_optimizer": keras.optimizers.Adam(3e-3),
        "g_optimizer": keras.optimizers.Adam(3e-3),
        "loss_fn": keras.losses.BinaryCrossentropy(from_logits=True),
    }


def images() -> tf.data.Dataset:
    """48 images in batches of 16, in a fixed order (Keras' reference below does not shuffle)."""
    return tf.data.Dataset.from_tensor_slices(np.random.default_rng(4).uniform(size=(48, 8, 8, 1)).astype("float32"))


def keras_mirrored(initial: list[np.ndarray]) -> list[np.ndarray]:
    """The GAN trained by Keras' own fit under MirroredStrategy on the same 2 devices, from ``initial``."""
    with tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope():
        model = make_gan()
        model.built = True  # Keras' fit would otherwise try to call it to build it (it has no call)
        model.set_weights(initial)
        model.compile(**gan_compile())
        # Keras' fit fails under MirroredStrategy when these are built at their first update, inside a replica.
        model.d_optimizer.build(model.discriminator.trainable_weights)
        model.g_optimizer.build(model.generator.trainable_weights)
    model.fit(images().batch(16), epochs=2, verbose=0)
    return model.get_weights()


@pytest.mark.slow
def test_auto_trains_a_gan_as_mirrored_and_says_why():
    trained = {}
    for name in ("auto", "mirrored"):
        par = Parallel(name, devices=2, seed=11)
        model = par.build(make_gan, **gan_compile())
        initial = model.get_weights()
        history = par.fit(images().batch(16), epochs=2, verbose=0)
        trained[name] = (par, initial, model.get_weights(), history.history)
    auto, initial, weights, history = trained["auto"]
    assert auto.strategy == "mirrored" and auto.num_replicas == 2
    text = auto.explain()
    # Keras numbers a class's auto-names per process: 'gan', 'gan_1', ...
    assert re.search(r"the model could not be measured \(model 'gan(_\d+)?' has no call of its own to trace", text)
    assert "estimate_memory(model.discriminator), estimate_memory(model.generator)" in text, text
    assert "chose 'mirrored' on 2 devices, which needs no measurement" in text, text
    assert "keras.Input" not in text and "model.build" not in text  # advice that does not fit a GAN
    _, mirrored_initial, mirrored_weights, mirrored_history = trained["mirrored"]
    for got, want in zip(initial, mirrored_initial):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(weights, mirrored_weights):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    assert any(not np.allclose(a, b) for a, b in zip(initial, weights))  # it trained
    for got, want in zip(weights, keras_mirrored(initial)):  # and as Keras trains it under the same strategy
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    assert sorted(history) == ["d_loss", "g_loss"] and len(history["d_loss"]) == 2
    np.testing.assert_allclose(history["d_loss"], mirrored_history["d_loss"], rtol=1e-5)
    assert auto.model.d_optimizer.iterations.numpy() == auto.model.g_optimizer.iterations.numpy() == 6


def test_with_a_memory_limit_auto_says_a_gans_fit_is_unknown():
    par = Parallel("auto", devices=2, device_memory="1GiB")
    par.build(make_gan, **gan_compile())
    assert par.strategy == "mirrored"
    text = par.explain()
    assert "the model could not be measured" in text
    variables = sum(int(np.prod(w.shape)) * 4 for w in par.model.weights)  # float32
    assert (
        f"whether it fits device memory 1.00 GiB is unknown (its variables alone take {variables / 1024:.2f} KiB)"
        in (text)
    ), text


def test_a_gan_whose_variables_alone_exceed_the_limit_is_said_not_to_fit():
    par = Parallel("auto", devices=2, device_memory="1KiB")
    par.build(make_gan, **gan_compile())
    assert par.strategy == "mirrored"  # nothing else could train it; the explanation warns
    assert "> device memory 1.00 KiB: it does not fit one device, and auto splits only a model it can measure" in (
        par.explain()
    )


def test_on_one_device_auto_picks_single_for_a_gan():
    par = Parallel("auto", devices=1, device_memory="1GiB")
    par.build(make_gan, **gan_compile())
    assert par.strategy == "single"
    assert "chose 'single' (one device is available), which needs no measurement" in par.explain()


def test_estimate_memory_of_a_gan_names_its_parts():
    gan = make_gan()
    with pytest.raises(ValueError, match=r"no call of its own.*estimate_memory\(model.discriminator\)"):
        estimate_memory(gan)
    assert estimate_memory(gan.generator, batch_size=2).parameters > 0


class Lazy(keras.Model):
    """A subclassed model with a call, built at its first batch."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x)


def test_an_unbuilt_model_is_told_to_build_itself_for_auto_to_measure_it():
    par = Parallel("auto", devices=2)
    par.build(Lazy, optimizer="sgd", loss="mse")
    assert par.strategy == "mirrored"
    text = par.explain()
    # Keras numbers a class's auto-names per process: 'lazy', 'lazy_1', ...
    advice = r"model 'lazy(_\d+)?' is not built: start it with keras\.Input\(\.\.\.\), or call model\.build"
    assert re.search(advice, text), text
    x = np.ones((8, 3), "float32")
    par.fit(x, np.zeros((8, 2), "float32"), batch_size=4, epochs=1, verbose=0)
    assert [w.shape for w in par.model.weights] == [(3, 2), (2,)]


class NeedsTwo(keras.Model):
    """Built with a shape it cannot be called with: the probe batch fails."""

    def __init__(self):
        super().__init__()
        self.a = keras.layers.Dense(3, name="a")
        self.a.build((None, 4))

    def call(self, pair):
        return self.a(pair[0]) + pair[1]


def needs_two() -> keras.Model:
    model = NeedsTwo()
    model.build((2, 4))
    return model


def test_a_refused_probe_batch_asks_for_a_sample():
    par = Parallel("auto", devices=2)
    par.build(needs_two, optimizer="sgd", loss="mse")
    text = par.explain()
    assert "could not be called on a probe batch" in text and "its activations were not measured" in text, text
    assert "pass sample=<a batch of the model's inputs> to let auto measure them" in text, text


def test_the_rule_for_an_unmeasured_model():
    for devices, strategy in ((1, "single"), (2, "mirrored"), (4, "mirrored")):
        chosen = decide(num_workers=1, num_devices=devices, estimate=None, device_memory=100, unmeasured="why")
        assert (chosen.strategy, chosen.settings, chosen.copies, chosen.tensor) == (strategy, {}, 1, 1)
        assert chosen.explain().startswith(f"the model could not be measured (why): chose {strategy!r}")
    unknown = decide(num_workers=1, num_devices=2, estimate=None, device_memory=None, unmeasured="why")
    assert (
        unknown.explain()
        == "the model could not be measured (why): chose 'mirrored' on 2 devices, which needs no measurement"
    )
