"""Keras' own patterns on every backend, against plain Keras from the same initial weights: a model's own
train_step/test_step/predict_step, its own compile (a GAN with two optimizers), and masked sequence losses."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from paraml import Parallel


# -- a model's own steps: the "Customizing what happens in fit()" guide's low-level example ---------------------------
class OwnSteps(keras.Model):
    """No compiled loss: its train_step computes one (MSE plus an MAE term), tracks it and an MAE of its own."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_fn = keras.losses.MeanSquaredError()
        self.extra_fn = keras.losses.MeanAbsoluteError()
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae_metric]

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.loss_fn(y, y_pred) + 0.5 * self.extra_fn(y, y_pred)  # Keras losses: scaled per replica
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
        self.loss_tracker.update_state(keras.ops.mean(keras.ops.square(y - y_pred)))  # unscaled: any replica count
        self.mae_metric.update_state(y, y_pred)
        return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        self.loss_tracker.update_state(keras.ops.mean(keras.ops.square(y - y_pred)))
        self.mae_metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}

    def predict_step(self, data):
        return {"doubled": 2.0 * self(data, training=False)}


def own_steps_model() -> keras.Model:
    keras.utils.set_random_seed(3)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="tanh", name="hidden")(inputs)
    return OwnSteps(inputs, keras.layers.Dense(2, name="out")(hidden))


@pytest.fixture(scope="module")
def own_reference():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, 6)).astype("float32")
    y = np.stack([x[:, 0] - x[:, 1], x[:, 2] * 0.5], axis=1).astype("float32")
    model = own_steps_model()
    initial = model.get_weights()
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return dict(
        x=x,
        y=y,
        initial=initial,
        weights=model.get_weights(),
        history=history.history,
        evaluate=model.evaluate(x, y, batch_size=16, return_dict=True, verbose=0),
    )


@pytest.mark.parametrize("strategy, devices", [("single", None), ("mirrored", 2), ("model_parallel", 2)])
def test_a_models_own_steps_run_as_in_keras(own_reference, strategy, devices):
    par = Parallel(strategy, devices=devices)
    model = par.build(own_steps_model, optimizer=keras.optimizers.SGD(0.1))  # no loss: the train_step has its own
    model.set_weights(own_reference["initial"])
    history = par.fit(own_reference["x"], own_reference["y"], batch_size=16, epochs=2, shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), own_reference["weights"]):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    assert history.history.keys() == own_reference["history"].keys() == {"loss", "mae"}
    for name, values in own_reference["history"].items():
        np.testing.assert_allclose(history.history[name], values, rtol=1e-5)
    evaluated = par.evaluate(own_reference["x"], own_reference["y"], batch_size=16)
    assert evaluated == pytest.approx(own_reference["evaluate"], rel=1e-5)
    predicted = par.predict(own_reference["x"][:5], batch_size=4)
    np.testing.assert_allclose(predicted["doubled"], 2.0 * model(own_reference["x"][:5]).numpy(), rtol=1e-5, atol=1e-6)


def test_an_own_train_step_keeps_steps_per_execution_and_callbacks(own_reference):
    par = Parallel("mirrored", devices=2, steps_per_execution=3)  # 4 batches an epoch: executions of 3 and 1
    model = par.build(own_steps_model, optimizer=keras.optimizers.SGD(0.1))
    model.set_weights(own_reference["initial"])
    seen = []
    log_names = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: seen.append(sorted(logs)))
    par.fit(
        own_reference["x"], own_reference["y"], batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=[log_names]
    )
    for got, want in zip(model.get_weights(), own_reference["weights"]):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    assert seen == [["loss", "mae"]] * 2


def test_an_own_train_step_under_micro_batches_is_refused_at_build():
    par = Parallel("model_parallel", devices=2, micro_batches=2)
    with pytest.raises(ValueError, match=r"own train_step.*micro_batches=2.*micro_batches=1"):
        par.build(own_steps_model, optimizer="sgd")


def test_a_model_without_its_own_train_step_still_needs_a_loss():
    with pytest.raises(ValueError, match="loss is required"):
        Parallel("single").build(lambda: keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]))


# -- a model's own compile: the Keras GAN example, two optimizers -----------------------------------------------------
class GAN(keras.Model):
    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator, self.generator, self.latent_dim = discriminator, generator, latent_dim
        self.seed_generator = keras.random.SeedGenerator(1337)

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer, self.g_optimizer, self.loss_fn = d_optimizer, g_optimizer, loss_fn
        self.d_loss_metric = keras.metrics.Mean(name="d_loss")
        self.g_loss_metric = keras.metrics.Mean(name="g_loss")

    @property
    def metrics(self):
        return [self.d_loss_metric, self.g_loss_metric]

    def train_step(self, real):
        batch = tf.shape(real)[0]
        latent = keras.random.normal((batch, self.latent_dim), seed=self.seed_generator)
        combined = tf.concat([self.generator(latent), real], axis=0)
        labels = tf.concat([tf.ones((batch, 1)), tf.zeros((batch, 1))], axis=0)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(combined))
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
        latent = keras.random.normal((batch, self.latent_dim), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(tf.zeros((batch, 1)), self.discriminator(self.generator(latent)))
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        self.d_loss_metric.update_state(d_loss)
        self.g_loss_metric.update_state(g_loss)
        return {"d_loss": self.d_loss_metric.result(), "g_loss": self.g_loss_metric.result()}


def make_gan() -> keras.Model:
    keras.utils.set_random_seed(5)
    discriminator = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]
    )
    generator = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(4)])
    gan = GAN(discriminator, generator, latent_dim=3)
    gan.built = True  # its parts are: Keras' fit would otherwise try to call it (it has no call)
    return gan


GAN_COMPILE = dict(
    d_optimizer=keras.optimizers.Adam(1e-2),
    g_optimizer=keras.optimizers.Adam(2e-2),
    loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
)


def gan_data() -> np.ndarray:
    return np.random.default_rng(2).normal(size=(48, 4)).astype("float32")


def keras_gan(strategy: tf.distribute.Strategy, initial, epochs: int) -> list[np.ndarray]:
    with strategy.scope():
        model = make_gan()
        model.set_weights(initial)
        model.compile(
            **{k: v.from_config(v.get_config()) if k.endswith("optimizer") else v for k, v in GAN_COMPILE.items()}
        )
        # Keras' fit fails under MirroredStrategy when these are built at their first update, inside a replica.
        model.d_optimizer.build(model.discriminator.trainable_weights)
        model.g_optimizer.build(model.generator.trainable_weights)
    model.fit(tf.data.Dataset.from_tensor_slices(gan_data()).batch(16), epochs=epochs, verbose=0)
    return model.get_weights()


@pytest.mark.parametrize("strategy, devices", [("single", None), ("mirrored", 2)])
@pytest.mark.slow
def test_a_gan_with_its_own_compile_trains_as_in_keras(strategy, devices):
    par = Parallel(strategy, devices=devices)
    model = par.build(make_gan, **GAN_COMPILE)
    initial = model.get_weights()
    par.fit(tf.data.Dataset.from_tensor_slices(gan_data()).batch(16), epochs=2, verbose=0)
    if strategy == "single":
        keras_strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    else:
        keras_strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    for got, want in zip(model.get_weights(), keras_gan(keras_strategy, initial, 2)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    assert model.d_optimizer.iterations.numpy() == model.g_optimizer.iterations.numpy() == 6


@pytest.mark.slow
def test_a_gans_checkpoint_holds_both_optimizers_and_resumes_exactly(tmp_path):
    data = tf.data.Dataset.from_tensor_slices(gan_data()).batch(16)
    whole = Parallel("single")
    whole.build(make_gan, **GAN_COMPILE)
    whole.fit(data, epochs=2, verbose=0)

    first = Parallel("single")
    first.build(make_gan, **GAN_COMPILE)
    first.fit(data, epochs=1, verbose=0, checkpoint_dir=tmp_path)
    stored = {name.split("/")[0] for name, _ in tf.train.list_variables(str(tmp_path / "ckpt-000001" / "ckpt"))}
    assert {"extra_d_optimizer", "extra_g_optimizer"} <= stored
    resumed = Parallel("single")
    model = resumed.build(make_gan, **GAN_COMPILE)
    resumed.fit(data, epochs=2, verbose=0, checkpoint_dir=tmp_path)
    for got, want in zip(model.get_weights(), whole.model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    for mine, theirs in ((model.d_optimizer, whole.model.d_optimizer), (model.g_optimizer, whole.model.g_optimizer)):
        for got, want in zip(mine.variables, theirs.variables):
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6, atol=1e-7)


def test_an_argument_the_models_compile_does_not_take_is_named():
    with pytest.raises(
        TypeError,
        match=r"argument 'loss' \(did you mean 'loss_fn'\?\): GAN.compile\(\) takes d_optimizer, g_optimizer, loss_fn",
    ):
        Parallel("single").build(make_gan, loss="mse", **GAN_COMPILE)


# -- masked sequence losses: the mean over the global batch's real tokens ---------------------------------------------
def masked_tagger() -> keras.Model:
    keras.utils.set_random_seed(7)
    tokens = keras.Input((10,), dtype="int32")
    hidden = keras.layers.Embedding(12, 6, mask_zero=True)(tokens)
    hidden = keras.layers.LSTM(8, return_sequences=True)(hidden)
    return keras.Model(tokens, keras.layers.Dense(5)(hidden))


@pytest.fixture(scope="module")
def tagged():
    rng = np.random.default_rng(4)
    lengths = np.where(np.arange(64) % 2 == 0, 10, 2)  # rows with very different numbers of real tokens
    rng.shuffle(lengths)
    x = np.zeros((64, 10), np.int32)
    for row, n in enumerate(lengths):
        x[row, :n] = rng.integers(1, 12, size=n)
    y = (x % 5).astype("int32")
    model = masked_tagger()
    initial = model.get_weights()
    model.compile(
        optimizer=keras.optimizers.SGD(0.5), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return dict(
        x=x,
        y=y,
        initial=initial,
        weights=model.get_weights(),
        history=history.history["loss"],
        evaluate=model.evaluate(x, y, batch_size=16, verbose=0),
    )


@pytest.mark.parametrize(
    "strategy, devices, options",
    [("single", None, {}), ("mirrored", 2, {}), ("model_parallel", 2, {"micro_batches": 2})],
)
@pytest.mark.slow
def test_a_masked_sequence_loss_is_the_mean_over_the_global_batchs_tokens(tagged, strategy, devices, options):
    par = Parallel(strategy, devices=devices, **options)
    model = par.build(
        masked_tagger,
        optimizer=keras.optimizers.SGD(0.5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.set_weights(tagged["initial"])
    history = par.fit(tagged["x"], tagged["y"], batch_size=16, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["loss"], tagged["history"], rtol=1e-5)
    for got, want in zip(model.get_weights(), tagged["weights"]):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    assert par.evaluate(tagged["x"], tagged["y"], batch_size=16)["loss"] == pytest.approx(tagged["evaluate"], rel=1e-5)
