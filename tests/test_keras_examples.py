"""The Keras examples' own code under paraml, against plain Keras from the same initial weights: the DCGAN of
"GAN overriding Model.train_step" (keras.io, Keras 3: loss trackers made in its own ``compile``, two optimizers, a
``SeedGenerator``), a model whose own ``compile`` makes state after paraml built it, and keras_hub tasks' own compile
defaults (only the arguments given to ``build`` override them, as in ``task.compile(...)``)."""

from contextlib import nullcontext

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf
from keras import layers, ops

from paraml import Parallel

# paraml's note on an own train_step under data parallelism (tested with that feature, not here)
pytestmark = pytest.mark.filterwarnings("ignore:.*train_step runs on each of the")

LATENT = 4


# -- the DCGAN example, at 8x8x1 -----------------------------------------------------------------------------------
class GAN(keras.Model):
    """The example's GAN as written (Keras 3 version), with its label noise in a method of its own (see below)."""

    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.seed_generator = keras.random.SeedGenerator(1337)

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn
        self.d_loss_metric = keras.metrics.Mean(name="d_loss")
        self.g_loss_metric = keras.metrics.Mean(name="g_loss")

    @property
    def metrics(self):
        return [self.d_loss_metric, self.g_loss_metric]

    def label_noise(self, shape):
        return tf.random.uniform(shape)  # the example's: TensorFlow's op-level stream

    def train_step(self, real_images):
        batch_size = ops.shape(real_images)[0]
        random_latent_vectors = keras.random.normal(shape=(batch_size, self.latent_dim), seed=self.seed_generator)
        generated_images = self.generator(random_latent_vectors)
        combined_images = ops.concatenate([generated_images, real_images], axis=0)
        labels = ops.concatenate([ops.ones((batch_size, 1)), ops.zeros((batch_size, 1))], axis=0)
        labels += 0.05 * self.label_noise(tf.shape(labels))
        with tf.GradientTape() as tape:
            predictions = self.discriminator(combined_images)
            d_loss = self.loss_fn(labels, predictions)
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
        random_latent_vectors = keras.random.normal(shape=(batch_size, self.latent_dim), seed=self.seed_generator)
        misleading_labels = ops.zeros((batch_size, 1))
        with tf.GradientTape() as tape:
            predictions = self.discriminator(self.generator(random_latent_vectors))
            g_loss = self.loss_fn(misleading_labels, predictions)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        self.d_loss_metric.update_state(d_loss)
        self.g_loss_metric.update_state(g_loss)
        return {"d_loss": self.d_loss_metric.result(), "g_loss": self.g_loss_metric.result()}


class SeededNoiseGAN(GAN):
    """Label noise from the model's SeedGenerator, whose state a checkpoint holds. ``tf.random.uniform``'s stream is
    the state of its op's kernel, which no checkpoint (paraml's or Keras') saves: a resumed run draws the first
    epoch's noise again (measured: 2.6e-4 from the uninterrupted weights after 1 + 1 epochs)."""

    def label_noise(self, shape):
        return keras.random.uniform(shape, seed=self.seed_generator)


def make_dcgan(gan_class=GAN, build=False):
    keras.utils.set_random_seed(3)
    discriminator = keras.Sequential(
        [
            keras.Input(shape=(8, 8, 1)),
            layers.Conv2D(4, kernel_size=4, strides=2, padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Conv2D(8, kernel_size=4, strides=2, padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Flatten(),
            layers.Dropout(0.2),
            layers.Dense(1, activation="sigmoid"),
        ],
        name="discriminator",
    )
    generator = keras.Sequential(
        [
            keras.Input(shape=(LATENT,)),
            layers.Dense(2 * 2 * 8),
            layers.Reshape((2, 2, 8)),
            layers.Conv2DTranspose(8, kernel_size=4, strides=2, padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Conv2DTranspose(4, kernel_size=4, strides=2, padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Conv2D(1, kernel_size=5, padding="same", activation="sigmoid"),
        ],
        name="generator",
    )
    gan = gan_class(discriminator=discriminator, generator=generator, latent_dim=LATENT)
    if build:  # as paraml's build docstring says of subclassed models; it locks the model's state
        gan.build((None, 8, 8, 1))
    return gan


def dcgan_compile():
    return dict(
        d_optimizer=keras.optimizers.Adam(learning_rate=1e-3),
        g_optimizer=keras.optimizers.Adam(learning_rate=2e-3),
        loss_fn=keras.losses.BinaryCrossentropy(),
    )


def images():
    return tf.data.Dataset.from_tensor_slices(np.random.default_rng(0).uniform(size=(32, 8, 8, 1)).astype("float32"))


def keras_dcgan(initial, strategy=None, epochs=2, gan_class=GAN):
    """Keras' own fit of the example, from ``initial`` weights; under a strategy with the two steps Keras needs."""
    with strategy.scope() if strategy is not None else nullcontext():
        gan = make_dcgan(gan_class)
        gan.set_weights(initial)
        gan.compile(**dcgan_compile())
        if strategy is not None:
            gan.built = True  # Keras' fit under a strategy calls an unbuilt model to build it; this one has no call
            # built at their first update, inside a replica, they break Keras' fit under MirroredStrategy
            gan.d_optimizer.build(gan.discriminator.trainable_weights)
            gan.g_optimizer.build(gan.generator.trainable_weights)
    history = gan.fit(images().batch(8), epochs=epochs, verbose=0)
    return gan, history.history


def assert_same_weights(got, want, rtol=1e-4, atol=1e-6):
    assert len(got) == len(want)
    for mine, theirs in zip(got, want):
        np.testing.assert_allclose(mine, theirs, rtol=rtol, atol=atol)


@pytest.mark.parametrize("strategy, devices", [("single", None), ("mirrored", 2)])
@pytest.mark.slow
def test_the_dcgan_example_trains_as_in_keras(strategy, devices):
    """The unmodified example: paraml equals plain Keras (single) and Keras' fit under MirroredStrategy on the same
    two devices (mirrored), the label noise of ``tf.random.uniform`` included (its op seed is the same in both)."""
    par = Parallel(strategy, devices=devices, seed=0)
    model = par.build(make_dcgan, **dcgan_compile())
    initial = model.get_weights()
    history = par.fit(images().batch(8), epochs=2, verbose=0)
    keras_strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]) if strategy == "mirrored" else None
    reference, keras_history = keras_dcgan(initial, keras_strategy)
    assert_same_weights(model.get_weights(), reference.get_weights())
    assert set(history.history) == set(keras_history) == {"d_loss", "g_loss"}
    for key in keras_history:
        np.testing.assert_allclose(history.history[key], keras_history[key], rtol=1e-4)
    assert model.d_optimizer.iterations.numpy() == model.g_optimizer.iterations.numpy() == 8
    assert any(np.abs(a - b).max() > 1e-3 for a, b in zip(model.get_weights(), initial))  # it did train


@pytest.mark.slow
def test_auto_trains_the_dcgan_example_as_mirrored():
    """auto cannot measure the example (no call of its own), so it trains it data-parallel and says why."""
    trained = {}
    for strategy in ("auto", "mirrored"):
        memory = {"device_memory": "1GiB"} if strategy == "auto" else {}
        par = Parallel(strategy, devices=2, seed=0, **memory)
        model = par.build(make_dcgan, **dcgan_compile())
        par.fit(images().batch(8), epochs=1, verbose=0)
        trained[strategy] = (par, model.get_weights())
    par = trained["auto"][0]
    assert par.strategy == "mirrored" and "could not be measured" in par.explain(), par.explain()
    assert_same_weights(trained["auto"][1], trained["mirrored"][1], rtol=1e-6, atol=0)


def test_the_dcgan_built_in_model_fn_trains_as_keras_trains_it_unbuilt():
    """Built inside model_fn (the advice for subclassed models), its own compile still makes its trackers, as Keras
    lets it when it compiles before fit builds the model; plain Keras refuses to compile it built."""
    with pytest.raises(ValueError, match="cannot add new elements of state"):
        make_dcgan(build=True).compile(**dcgan_compile())
    par = Parallel("single", seed=0)
    model = par.build(lambda: make_dcgan(build=True), **dcgan_compile())
    assert model.built and [m.name for m in model.metrics] == ["d_loss", "g_loss"]
    initial = model.get_weights()
    history = par.fit(images().batch(8), epochs=1, verbose=0)
    reference, keras_history = keras_dcgan(initial, epochs=1)
    assert_same_weights(model.get_weights(), reference.get_weights())
    np.testing.assert_allclose(history.history["d_loss"], keras_history["d_loss"], rtol=1e-4)
    with pytest.raises(ValueError, match="cannot add new elements of state"):  # locked again after its compile
        model.extra = keras.metrics.Mean()


@pytest.mark.parametrize("strategy, devices", [("single", None), ("mirrored", 2)])
@pytest.mark.slow
def test_the_dcgans_checkpoint_holds_both_optimizers_and_resumes_exactly(tmp_path, strategy, devices):
    def make():
        return make_dcgan(SeededNoiseGAN)

    whole = Parallel(strategy, devices=devices, seed=0)
    whole.build(make, **dcgan_compile())
    whole.fit(images().batch(8), epochs=2, verbose=0)

    first = Parallel(strategy, devices=devices, seed=0)
    first.build(make, **dcgan_compile())
    first.fit(images().batch(8), epochs=1, verbose=0, checkpoint_dir=tmp_path / "fit")
    stored = {name.split("/")[0] for name, _ in tf.train.list_variables(str(tmp_path / "fit" / "ckpt-000001" / "ckpt"))}
    assert {"extra_d_optimizer", "extra_g_optimizer"} <= stored
    saved = [name for name, _ in tf.train.list_variables(str(tmp_path / "fit" / "ckpt-000001" / "ckpt"))]
    slots = {"d_optimizer": "discriminator", "g_optimizer": "generator"}
    for name, part in slots.items():  # every variable of each: a momentum and a velocity per weight, the counters
        count = sum(key.startswith(f"extra_{name}/") and key.endswith("VARIABLE_VALUE") for key in saved)
        assert count == len(getattr(first.model, name).variables) > 2 * len(getattr(first.model, part).weights)
    first.save(tmp_path / "saved")

    resumed = Parallel(strategy, devices=devices, seed=0)  # fit(checkpoint_dir=) resumes by itself
    model = resumed.build(make, **dcgan_compile())
    resumed.fit(images().batch(8), epochs=2, verbose=0, checkpoint_dir=tmp_path / "fit")
    restored = Parallel(strategy, devices=devices, seed=0)  # save / restore by hand
    again = restored.build(make, **dcgan_compile())
    state = restored.restore(tmp_path / "saved")
    restored.fit(images().batch(8), epochs=2, initial_epoch=state.epoch, verbose=0)
    for run in (model, again):
        assert_same_weights(run.get_weights(), whole.model.get_weights(), rtol=1e-6, atol=1e-7)
        for name in slots:
            assert_same_weights(
                [v.numpy() for v in getattr(run, name).variables],
                [v.numpy() for v in getattr(whole.model, name).variables],
                rtol=1e-6,
                atol=1e-7,
            )


def test_a_gan_under_model_parallel_is_refused_with_what_to_use():
    with pytest.raises(ValueError, match=r"model 'gan.*' is not built.*trains under 'single', 'mirrored'"):
        Parallel("model_parallel", devices=2).build(make_dcgan, **dcgan_compile())


# -- a model built by paraml at its first batch, whose own compile makes a tracker -----------------------------------
class TrackedInCompile(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden = layers.Dense(4, activation="relu")
        self.out = layers.Dense(1)

    def call(self, x):
        return self.out(self.hidden(x))

    def compile(self, optimizer, loss):
        super().compile(optimizer=optimizer, loss=loss)
        self.tracker = keras.metrics.Mean(name="squared")

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x, y, self(x, training=True))
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
        self.tracker.update_state(loss)
        return {"squared": self.tracker.result()}


def test_a_lazily_built_models_own_compile_makes_state_as_in_keras():
    """paraml builds such a model (at its first batch) before it compiles it; Keras compiles first, then builds."""
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(32, 3)).astype("float32"), rng.normal(size=(32, 1)).astype("float32")
    par = Parallel("single", seed=0)
    model = par.build(TrackedInCompile, optimizer=keras.optimizers.SGD(0.1), loss="mse")
    assert not model.weights
    par.predict(x[:8])  # built at its first batch, then compiled
    assert model.built and [m.name for m in model.metrics][-1] == "squared"
    initial = model.get_weights()
    history = par.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False).history
    reference = TrackedInCompile()
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    reference(x[:1])  # built after its compile, as Keras' fit builds it
    reference.set_weights(initial)
    keras_history = reference.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False).history
    assert set(history) == set(keras_history) == {"squared"}
    np.testing.assert_allclose(history["squared"], keras_history["squared"], rtol=1e-4)
    assert_same_weights(model.get_weights(), reference.get_weights())


# -- compile defaults: only the arguments given override the model's own ---------------------------------------------
SEQ, VOCAB = 8, 64


def token_data(rows=32):
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, VOCAB, (rows, SEQ)).astype("int32")
    mask = np.ones((rows, SEQ), "int32")
    mask[::3, -3:] = 0
    return tokens * mask, mask


def tiny_backbone():
    """One block of width 16 over the test vocabulary, no dropout (the numbers equal Keras' run for run)."""
    sizes = {"num_layers": 1, "num_heads": 2, "hidden_dim": 16, "intermediate_dim": 32}
    return {"vocabulary_size": VOCAB, "max_sequence_length": SEQ, "dropout": 0.0, **sizes}


def causal_lm():
    keras.utils.set_random_seed(4)
    backbone = keras_hub.models.GPT2Backbone(**tiny_backbone())
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def causal_lm_data():
    tokens, mask = token_data()
    x = {"token_ids": tokens[:, :-1], "padding_mask": mask[:, :-1]}
    return x, tokens[:, 1:], mask[:, 1:].astype("float32")


def text_classifier():
    keras.utils.set_random_seed(4)
    backbone = keras_hub.models.BertBackbone(**tiny_backbone())
    return keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=2, preprocessor=None, dropout=0.0)


def classifier_data():
    tokens, mask = token_data()
    x = {"token_ids": tokens, "segment_ids": np.zeros_like(tokens), "padding_mask": mask}
    return x, (tokens[:, 0] > VOCAB // 2).astype("int32"), None


def keras_task_fit(make, initial, arguments, data, epochs=2):
    x, y, w = data
    task = make()
    task.set_weights(initial)
    task.compile(**arguments)
    history = task.fit(x, y, sample_weight=w, batch_size=16, epochs=epochs, verbose=0, shuffle=False)
    return task, history.history


def top5():
    return keras.metrics.SparseTopKCategoricalAccuracy(k=5, name="top5")


def xent():
    return keras.metrics.SparseCategoricalCrossentropy(from_logits=True, name="xent")


@pytest.mark.parametrize(
    "make, data, arguments, kept",
    [
        # metrics given: the causal LM keeps its default weighted_metrics (SparseCategoricalAccuracy)
        (causal_lm, causal_lm_data, lambda: {"optimizer": "adam", "metrics": [top5()]}, "sparse_categorical_accuracy"),
        # weighted_metrics given: the classifier keeps its default metrics; no loss given: its own
        (
            text_classifier,
            classifier_data,
            lambda: {"optimizer": keras.optimizers.Adam(1e-3), "weighted_metrics": [xent()]},
            "sparse_categorical_accuracy",
        ),
        # nothing but metrics given: the task's own optimizer (Adam(2e-5)) and loss
        (causal_lm, causal_lm_data, lambda: {"metrics": [top5()]}, "sparse_categorical_accuracy"),
    ],
    ids=["causal_lm-metrics", "classifier-weighted_metrics", "causal_lm-no_optimizer"],
)
@pytest.mark.slow
def test_a_keras_hub_task_keeps_its_compile_defaults(make, data, arguments, kept):
    par = Parallel("single", seed=0)
    model = par.build(make, **arguments())
    initial = model.get_weights()
    x, y, w = data()
    history = par.fit(x, y, sample_weight=w, batch_size=16, epochs=2, verbose=0, shuffle=False).history
    reference, keras_history = keras_task_fit(make, initial, arguments(), data())
    assert kept in history and set(history) == set(keras_history)
    for key in keras_history:
        np.testing.assert_allclose(history[key], keras_history[key], rtol=1e-4, err_msg=key)
    assert_same_weights(model.get_weights(), reference.get_weights())
    assert type(model.optimizer) is type(reference.optimizer)
    assert float(model.optimizer.learning_rate) == pytest.approx(float(reference.optimizer.learning_rate))


@pytest.mark.slow
def test_a_keras_hub_task_under_mirrored_keeps_its_default_weighted_metric():
    par = Parallel("mirrored", devices=2, seed=0)
    par.build(causal_lm, optimizer="adam", metrics=["sparse_top_k_categorical_accuracy"])
    x, y, w = causal_lm_data()
    history = par.fit(x, y, sample_weight=w, batch_size=16, epochs=1, verbose=0).history
    assert set(history) == {"loss", "sparse_top_k_categorical_accuracy", "sparse_categorical_accuracy"}


class Recording(keras.Sequential):
    """A model whose own compile records the arguments it was called with (then compiles as Keras does)."""

    def compile(self, *args, **kwargs):
        self.received = dict(kwargs)
        super().compile(*args, **kwargs)


def recording():
    keras.utils.set_random_seed(0)
    return Recording([keras.Input((3,)), layers.Dense(2)])


BUILD_ARGUMENTS = {
    "loss_weights": [1.0],
    "metrics": ["mae"],
    "weighted_metrics": ["mse"],
    "auto_scale_loss": False,
    "weighted_metrics=None": None,
}


@pytest.mark.parametrize("name", list(BUILD_ARGUMENTS))
def test_only_the_arguments_given_reach_the_models_compile(name):
    """Each of build's compile arguments reaches the model's compile when given, and only then; the optimizer and
    loss always do (re-created under the backend), as the model's compile would pick them."""
    given = {name.split("=")[0]: BUILD_ARGUMENTS[name]}
    model = Parallel("single").build(recording, optimizer="sgd", loss="mse", **given)
    assert set(model.received) == {"optimizer", "loss", *given}
    for key, value in given.items():
        assert model.received[key] == value


def test_the_models_own_compile_picks_the_optimizer_and_loss_not_given():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = Parallel("single").build(recording, loss="mse")  # Keras' default: RMSprop, loss-scaled once
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert type(model.optimizer.inner_optimizer) is keras.optimizers.RMSprop
    assert set(model.received) == {"optimizer", "loss"}
    with pytest.raises(ValueError, match="loss is required"):
        Parallel("single").build(recording, optimizer="sgd")
    with pytest.raises(ValueError, match="loss is required"):
        Parallel("single").build(recording, optimizer="sgd", loss=None)


def test_an_argument_given_that_the_models_compile_does_not_take_is_named_as_keras_does():
    with pytest.raises(TypeError, match=r"argument 'metrics'.*GAN.compile\(\) takes d_optimizer, g_optimizer, loss_fn"):
        Parallel("single").build(make_dcgan, metrics=None, **dcgan_compile())
    with pytest.raises(TypeError, match="unexpected keyword argument 'metrics'"):
        make_dcgan().compile(metrics=None, **dcgan_compile())
