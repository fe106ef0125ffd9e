# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
#   refmath:
#     figures: 2
#     ids: [L2, L3, L5, O1, O2, O3, O4, O6, O7]
#     minutes: 55
# ---

# %% [markdown]
# # Lesson 5: the loss and the optimiser
#
# A language model is trained to predict the next token: the loss is the negative
# log-probability of the right token, and its gradient with respect to the logits is simply
# $p - y$. The same loss with the prompt masked out is the fine-tuning loss. Adam and AdamW then
# turn gradients into steps, and a schedule sets their size over time.
#
# **Prerequisites:** lesson 1 (softmax and its Jacobian, A5); NumPy indexing and broadcasting.
#
# **Goals:** derive the cross-entropy gradient $p - y$ and compute it by hand; tell the mean
# from the sum over answer tokens in the fine-tuning loss, and what each does to the gradient;
# take one Adam step by hand and see why bias correction is needed; see why weight decay inside
# Adam is not AdamW, and write AdamW's whole step from its equations; read the two common
# learning-rate schedules.
#
# **Catalogue IDs:** L2, L3, L5, O1, O2, O3, O4, O6, O7
#
# **Duration:** 55 minutes

# %%
import matplotlib.pyplot as plt
import numpy as np

from refmath.gradcheck import numerical_gradient, relative_error
from refmath.lessons import check, check_true
from refmath.optim import SGD, Adam
from refmath.softmax import softmax_forward

np.set_printoptions(precision=4, suppress=True)

# %% [markdown]
# ## L2, L3: cross-entropy and its gradient $p - y$
#
# At position $t$ the model gives logits $z_t \in \mathbb R^V$, the softmax turns them into
# probabilities $p_t$, and the right next token is $a_t$. The causal-LM loss averages the
# negative log-probability of the right tokens over the $T$ positions (L2):
#
# $$\ell = -\frac1T \sum_{t=1}^{T} \log p_{t, a_t},\qquad p_t = \operatorname{softmax}(z_t).$$
#
# Three positions, a vocabulary of four:

# %%
logits = np.array([[2.0, 1.0, 0.0, -1.0],
                   [0.0, 0.0, 0.0, 0.0],
                   [1.0, 3.0, 0.5, 0.0]])
targets = np.array([0, 2, 1])
p, _ = softmax_forward(logits)


def mean_loss():
    """L2 written out: the mean over the positions of -log p of the right token."""
    probs = softmax_forward(logits)[0]
    return -np.mean(np.log(probs[np.arange(len(targets)), targets]))


print("loss", mean_loss())
print("the uniform row (position 1) costs log 4 =", np.log(4))

# %% [markdown] tags=["question"]
# **Question.** Why is the gradient of $-\log p_{t,a_t}$ with respect to $z_t$ equal to
# $p_t - y_t$, with $y_t$ the one-hot vector of $a_t$?
#
# <!-- BEGIN SOLUTION -->
# Write the log-probability through the logits: $\log p_{t,a} = z_{t,a} - \log \sum_v e^{z_{t,v}}$.
# The first term has derivative $\partial z_{t,a} / \partial z_{t,u} = [u = a] = y_{t,u}$; the
# second has derivative $e^{z_{t,u}} / \sum_v e^{z_{t,v}} = p_{t,u}$. So
# $\partial(-\log p_{t,a})/\partial z_{t,u} = p_{t,u} - y_{t,u}$: the softmax Jacobian of A5 and
# the $1/p$ of the logarithm cancel. The mean over $T$ positions divides each row by $T$ (L3).
# <!-- END SOLUTION -->

# %% tags=["exercise"]
# Exercise 05.1: the gradient of the mean loss above with respect to `logits`, from `p` and
# `targets`.
dlogits_by_hand = ...
# BEGIN SOLUTION
dlogits_by_hand = (p - np.eye(4)[targets]) / 3
# END SOLUTION

# %%
check("05.1", dlogits_by_hand)

# %% [markdown]
# Central differences of the loss (`refmath.gradcheck.numerical_gradient`) confirm your formula
# independently of any backward code: each entry of the gradient is the change of the loss when
# that one logit moves by a little.

# %%
numeric = numerical_gradient(mean_loss, logits,
                             np.arange(logits.size)).reshape(logits.shape)
if dlogits_by_hand is not ...:
    print("largest relative error of your gradient against central differences:",
          float(relative_error(np.asarray(dlogits_by_hand, dtype=float), numeric).max()))

# %% [markdown]
# ## L5: the fine-tuning loss counts the answer only, as a sum or as a mean
#
# In supervised fine-tuning (SFT) the prompt $q$ is given, not predicted: only the answer tokens
# $a_1, \dots, a_m$ are scored. The catalogue writes the loss as a **sum** over the answer tokens,
#
# $$\ell_{\text{SFT}} = -\sum_{t=1}^{m} \log p(a_t \mid q, a_{<t}),$$
#
# while PyTorch's default, `reduction="mean"` (refmath's default too), divides by the number $n$
# of counted tokens. A 0/1 loss mask removes the prompt positions from both. The gradient of
# the sum is $p_t - y_t$ on each answer row; the mean's is that divided by $n$.
#
# Below, one sequence of six positions: the first three targets belong to the prompt, the last
# three to the answer.

# %%
sft_logits = np.array([[1.0, 0.0, 0.0, 2.0],
                       [0.0, 1.0, 0.0, 0.0],
                       [0.5, 0.5, 0.0, 0.0],
                       [2.0, 0.0, 1.0, 0.0],
                       [0.0, 3.0, 0.0, 1.0],
                       [np.log(3.0), 0.0, 0.0, 0.0]])
sft_targets = np.array([3, 1, 0, 0, 1, 0])
answer_mask = np.array([0, 0, 0, 1, 1, 1])
sft_p, _ = softmax_forward(sft_logits)
print("p of the right token at each position:", sft_p[np.arange(6), sft_targets])

# %% [markdown]
# The last row is there to be checked by hand: logits $(\log 3, 0, 0, 0)$ exponentiate to
# $(3, 1, 1, 1)$, so the right token has probability $3/6 = 1/2$ and costs $\log 2$.

# %% tags=["exercise"]
# Exercise 05.2: the SFT loss as the catalogue writes it, the sum over the answer tokens of -log p,
# from `sft_p`, `sft_targets` and `answer_mask`.
sft_sum_by_hand = ...
# BEGIN SOLUTION
sft_sum_by_hand = -np.sum(answer_mask * np.log(sft_p[np.arange(6), sft_targets]))
# END SOLUTION

# %%
check("05.2", sft_sum_by_hand)

# %%
# After the exercise: the library's cross_entropy_forward, its two reductions of the same tokens.
from refmath.losses import cross_entropy_forward  # noqa: E402

sft_mean, mean_cache = cross_entropy_forward(sft_logits, sft_targets, loss_mask=answer_mask)
sft_sum, sum_cache = cross_entropy_forward(sft_logits, sft_targets, loss_mask=answer_mask,
                                           reduction="sum")
print(f"sum {float(sft_sum):.4f} = {mean_cache.n_counted} x mean {float(sft_mean):.4f}")

# %% tags=["exercise"]
# Exercise 05.3: the last row's gradient of the summed loss, by hand. Its p is (3, 1, 1, 1) / 6 and
# its target is token 0. Write it as a NumPy array of four numbers.
last_row_gradient = ...
# BEGIN SOLUTION
last_row_gradient = np.array([3 / 6 - 1, 1 / 6, 1 / 6, 1 / 6])
# END SOLUTION

# %%
check("05.3", last_row_gradient)

# %% [markdown]
# All of it is one function, `cross_entropy_backward(dout, cache)`: $p - y$ on every counted row,
# zero on the others (padding marked with `ignore_index`, or a loss mask of 0), divided by the
# number $n$ of counted tokens for the mean and not for the sum, times the scalar upstream
# gradient `dout` (1 when the loss is the last thing computed).

# %% tags=["exercise"]
# Exercise 05.4: write the cross-entropy backward (no label smoothing here; lesson 6 adds it).
# `cache` is the CrossEntropyCache of cross_entropy_forward: `cache.probs` (..., V) = softmax of
# the logits, `cache.targets` (...) (0 at uncounted positions, so they index safely),
# `cache.counted` (...) True where the token is in the loss, `cache.n_counted`, and
# `cache.reduction` ("mean" or "sum"). Return dlogits, the shape of probs. The check runs it as
# the backward of cross_entropy_forward on seven cases of the registry (padding, loss masks, the
# sum, a single counted token, 3 leading axes) under the gradient check, and against
# cross_entropy_backward (and torch's cross_entropy, if installed).
def my_cross_entropy_backward(dout, cache):
    dlogits = ...
    # BEGIN SOLUTION
    onehot = np.eye(cache.probs.shape[-1])[cache.targets]
    per_token = cache.probs - onehot
    if cache.reduction == "mean":
        per_token = per_token / max(cache.n_counted, 1)
    dlogits = dout * np.where(cache.counted[..., None], per_token, 0.0)
    # END SOLUTION
    return dlogits


# %%
from refmath.losses import cross_entropy_backward

check("05.4", my_cross_entropy_backward)

# %% [markdown]
# With your backward written, the library's: on the six SFT positions, the gradient of the sum
# is zero on the prompt rows and $p - y$ on the answer rows, and the mean's is that divided by 3.

# %%
grad_sum = cross_entropy_backward(1.0, sum_cache)
grad_mean = cross_entropy_backward(1.0, mean_cache)
print("gradient of the summed SFT loss:\n", grad_sum)
np.testing.assert_allclose(grad_sum, 3 * grad_mean, rtol=1e-14)
np.testing.assert_array_equal(grad_sum[:3], 0.0)

# %% [markdown] tags=["question"]
# **Question.** A batch holds one example with a 2-token answer and one with a 200-token answer.
# With the mean over all counted tokens of the batch, and with the sum, how much does each
# example weigh in the gradient? What must change in the learning rate if one switches from the
# mean to the sum?
#
# <!-- BEGIN SOLUTION -->
# Both reductions weigh every counted token equally, so the long answer carries 200/202 of the
# gradient either way; what differs is the overall scale. The mean divides by $n = 202$, the sum
# does not, so the summed gradient is $n$ times larger and grows with the batch's answer length:
# the learning rate (for SGD) would have to shrink by about $n$ to take the same step. Adam
# divides by $\sqrt{\hat v}$, which removes a constant scale, but $n$ changes from batch to batch,
# so even there the sum gives more weight to batches with long answers. (Giving each *example*
# equal weight is a third choice: a mean per sequence, then a mean over sequences.)
# <!-- END SOLUTION -->

# %% [markdown]
# ## O1, O2: Adam and its bias correction
#
# Adam keeps running means of the gradient and of its square, started at zero:
#
# $$m_s = \beta_1 m_{s-1} + (1-\beta_1) g_s,\qquad v_s = \beta_2 v_{s-1} + (1-\beta_2) g_s^2,$$
#
# $$\hat m_s = \frac{m_s}{1-\beta_1^s},\qquad \hat v_s = \frac{v_s}{1-\beta_2^s},\qquad
# \theta_s = \theta_{s-1} - \eta\,\frac{\hat m_s}{\sqrt{\hat v_s} + \epsilon}.$$
#
# Early on $m_s$ and $v_s$ are too small by the factors $1 - \beta^s$ (they started at zero);
# dividing by those factors corrects them (O2): for a constant gradient, work out
# $m_s = (1-\beta_1)(1 + \beta_1 + \dots + \beta_1^{s-1}) g$ and see what the division leaves.

# %% tags=["exercise"]
# Exercise 05.5: the weights after Adam's *first* step from theta = (1, -2) with the gradient
# g = (0.3, -0.1), lr 0.1 and the default betas (0.9, 0.999) and eps 1e-8. Use the equations
# above: what are m_hat and v_hat after one step?
theta_after_one_step = ...
# BEGIN SOLUTION
g1 = np.array([0.3, -0.1])
m_hat1, v_hat1 = (1 - 0.9) * g1 / (1 - 0.9), (1 - 0.999) * g1**2 / (1 - 0.999)
theta_after_one_step = np.array([1.0, -2.0]) - 0.1 * m_hat1 / (np.sqrt(v_hat1) + 1e-8)
# END SOLUTION


# %%
check("05.5", theta_after_one_step)

# %% [markdown]
# The library's Adam over three steps of the same gradient: $\hat m_s = g$ and $\hat v_s = g^2$ at
# every step, as O2 says (printed after the exercise, since its first row is the answer).

# %%
params = {"w": np.array([1.0, -2.0])}
g = {"w": np.array([0.3, -0.1])}
adam = Adam(lr=0.1)
for step in range(1, 4):
    adam.step(params, g)
    m_hat, v_hat = adam.corrected_moments("w")
    print(f"step {step}: m_hat = {m_hat}, v_hat = {v_hat}, w = {params['w']}")
    np.testing.assert_allclose(m_hat, g["w"], rtol=1e-13)  # equal up to rounding
    np.testing.assert_allclose(v_hat, g["w"] ** 2, rtol=1e-13)

# %% [markdown]
# The first step has size $\eta$ in every coordinate, whatever the size of the gradient: Adam's
# step is normalised per coordinate.
#
# **What $v$ is, and what it is not.** $v_s$ is a running mean of $g^2$: a raw second moment.
# It is not a variance, since nothing subtracts the mean $m$ (the constant gradient above has
# variance 0, yet $\hat v_s = g^2$), and it is not the curvature, since no second derivative of
# the loss enters it. Dividing by $\sqrt{\hat v}$ divides by the recent root-mean-square size of
# the gradient, whatever the loss surface's curvature.

# %% tags=["exercise"]
# Exercise 05.6: a weight gets the gradient 0.3 at step 1 and 0.5 at step 2 (default betas).
# What is v_hat after step 2? (The two gradients' variance is 0.01: compare.)
v_hat_after_two = ...
# BEGIN SOLUTION
v2 = 0.999 * (1 - 0.999) * 0.3**2 + (1 - 0.999) * 0.5**2
v_hat_after_two = v2 / (1 - 0.999**2)
# END SOLUTION

# %%
check("05.6", v_hat_after_two)

# %% [markdown]
# ## O3, O4, O7: weight decay inside Adam or beside it
#
# For plain SGD, adding $\lambda\theta$ to the gradient is the same as shrinking the weights by
# $1 - \eta\lambda$ each step (O7). For Adam it is not: the decay term enters both moments (O3)
# and is divided by $\sqrt{\hat v}$ like the gradient, so its effect depends on the gradient
# history. A weight with large data gradients is barely decayed; a weight with no data gradient,
# as below, takes normalised steps of size about $\eta$ whatever $\lambda$ is, reaching 0 in about
# $1/\eta$ steps and then oscillating around it. AdamW (O4) applies the decay beside the Adam step,
#
# $$\theta_s = (1 - \eta\lambda)\,\theta_{s-1} - \eta\,\frac{\hat m_s}{\sqrt{\hat v_s} + \epsilon},$$
#
# with the moments computed from the data gradient only: the same shrinkage as SGD's.

# %% tags=["exercise"]
# Exercise 05.7: write AdamW's whole step for one array of weights, from the equations of O1, O2
# and O4: its value theta, its gradient g, the moments m and v before the step, the number s of
# the step (1 for the first), the learning rate lr, betas = (beta1, beta2), eps and the decay
# lambda (weight_decay). Return (new theta, new m, new v), the moments as the next step needs
# them, without changing the arrays you are given. The check runs it on five inputs of its own (a
# first step and later ones, gradients from 1e-4 to 3 so that eps matters, decay 0 and not)
# against refmath's AdamW and torch.optim.AdamW (if installed); a step that calls refmath's
# optimisers is refused.
def my_adamw_step(theta, g, m, v, s, lr, betas, eps, weight_decay):
    new_theta = new_m = new_v = ...
    # BEGIN SOLUTION
    beta1, beta2 = betas
    new_m = beta1 * m + (1 - beta1) * g
    new_v = beta2 * v + (1 - beta2) * g**2
    m_hat, v_hat = new_m / (1 - beta1**s), new_v / (1 - beta2**s)
    new_theta = (1 - lr * weight_decay) * theta - lr * m_hat / (np.sqrt(v_hat) + eps)
    # END SOLUTION
    return new_theta, new_m, new_v


# %%
check("05.7", my_adamw_step)

# %% tags=["exercise"]
# Exercise 05.8: the weight after 200 AdamW steps with a zero data gradient, lr 0.1 and weight
# decay 0.1, starting from 1, in closed form. (After the check, a plot runs the three optimisers
# of this section for 50 steps.)
adamw_after_200 = ...
# BEGIN SOLUTION
adamw_after_200 = (1 - 0.1 * 0.1) ** 200
# END SOLUTION

# %%
check("05.8", adamw_after_200)

# %%
from refmath.optim import AdamW  # noqa: E402  (after the exercises 05.7 and 05.8 ask for it)


def run(optimiser, steps=50):
    p = {"w": np.array([1.0])}
    path = [1.0]
    for _ in range(steps):
        optimiser.step(p, {"w": np.array([0.0])})
        path.append(float(p["w"][0]))
    return np.array(path)


decay = dict(lr=0.1, weight_decay=0.1, decay_of=lambda name: 0.1)
paths = {"SGD + L2": run(SGD(**decay)), "Adam + L2": run(Adam(**decay)),
         "AdamW": run(AdamW(**decay))}
fig, ax = plt.subplots(figsize=(5.5, 3.2), layout="constrained")
for (name, path), style in zip(paths.items(), ("-", "-", "--")):
    ax.plot(path, style, label=name)
ax.set(xlabel="step", ylabel="weight", title="a weight with no data gradient, decay 0.1, lr 0.1")
ax.legend()
plt.show()

# %%
# The three runs' ends: SGD + L2 shrinks exactly as AdamW does, Adam + L2 has crossed 0.
for name, path in paths.items():
    print(f"{name:10s}: after 50 steps {path[-1]:+.4f}")

# %% [markdown]
# ## O6: learning-rate schedules
#
# The original Transformer warmed up linearly for $w$ steps and then decayed as $1/\sqrt{s}$:
#
# $$\eta_s = d^{-1/2} \min\big(s^{-1/2},\ s\, w^{-3/2}\big).$$
#
# Many recent LLMs instead warm up linearly to a peak and follow half a cosine down to a floor;
# GPT-3 and Llama 2, for instance, decay to 10% of the peak (Brown et al., 2020; Touvron et al.,
# 2023):
#
# $$\eta_s = \eta_{\min} + \tfrac12(\eta_{\max} - \eta_{\min})
# \Big(1 + \cos\big(\pi\,\tfrac{s - w}{S - w}\big)\Big)\quad (w \le s \le S),$$
#
# with $S$ the total number of steps ($T$ stays the sequence length, as everywhere else).

# %% tags=["exercise"]
# Exercise 05.9: the peak of the original schedule for d = 512 and w = 4000 (where the two branches
# meet), and the warmup-cosine rate at step 11000 (half-way through its decay) for a peak of
# 3e-4, a floor of 3e-5 (10%), 2000 warmup steps and 20000 in all (the plot after the check
# draws both schedules). Give both as a pair (peak, half_way).
schedule_values = ...
# BEGIN SOLUTION
schedule_values = (512**-0.5 * 4000**-0.5, 3e-5 + 0.5 * (3e-4 - 3e-5))
# END SOLUTION

# %%
check("05.9", schedule_values)

# %%
# After the exercise: the library's two schedules.
from refmath.optim import transformer_schedule, warmup_cosine  # noqa: E402

steps = np.arange(1, 20001)
fig, axes = plt.subplots(1, 2, figsize=(9, 3), layout="constrained")
axes[0].plot(steps, [transformer_schedule(s, d_model=512, warmup=4000) for s in steps])
axes[0].set(title=r"original: $d^{-1/2}\min(s^{-1/2}, s\,w^{-3/2})$", xlabel="step",
            ylabel="learning rate")
axes[1].plot(steps, [warmup_cosine(s, max_lr=3e-4, warmup=2000, total=20000, min_lr=3e-5)
                     for s in steps])
axes[1].set(title="linear warmup, cosine decay to 10%", xlabel="step")
plt.show()

# %%
check_true("your peak is above the rates one step before and after it",
           lambda values: values[0] > max(transformer_schedule(3999, 512, 4000),
                                          transformer_schedule(4001, 512, 4000)),
           "the rate rises before s = w and falls after", of=schedule_values)

# %% [markdown]
# ## Exercises
#
# 1. Label smoothing: with `label_smoothing=eps` the target is $q = (1-\varepsilon) y +
#    \varepsilon / V$. Show that the gradient becomes $p - q$, and check it with
#    `cross_entropy_backward` on the three-position example.
# 2. Show that the cross-entropy gradient rows sum to zero. What does that say about adding the
#    same constant to every logit of a row?
# 3. Run Adam *without* bias correction (divide by 1 instead of $1-\beta^s$) on a constant
#    gradient: how large are the first ten steps compared with $\eta$? Why does $\epsilon$ matter
#    more then?
# 4. Give a weight a constant data gradient $g = 0.01$ and decay $\lambda = 0.1$ (lr 0.1). Where
#    does it settle under Adam + L2 and under AdamW? (Hint: Adam + L2 stops where the gradient it
#    sees, $g + \lambda\theta$, is zero; AdamW stops where the decay $\eta\lambda\theta$ cancels
#    Adam's normalised step, about $\eta\,\mathrm{sign}(g)$.) Why would $g = 1$ not tell them
#    apart?
# 5. Plot `warmup_cosine` with `warmup=0`: what goes wrong in the first steps of a Post-LN model
#    (lesson 2)?
#
# ## References
#
# - Vaswani et al. (2017), *Attention Is All You Need* (the inverse-square-root schedule).
# - Kingma and Ba (2015), *Adam: A Method for Stochastic Optimization*.
# - Loshchilov and Hutter (2019), *Decoupled Weight Decay Regularization* (AdamW).
# - Loshchilov and Hutter (2017), *SGDR: Stochastic Gradient Descent with Warm Restarts* (cosine).
# - Brown et al. (2020), *Language Models are Few-Shot Learners* (GPT-3: warmup, cosine to 10%).
# - Ouyang et al. (2022), *Training language models to follow instructions with human feedback*
#   (supervised fine-tuning).
# - Touvron et al. (2023), *Llama 2: Open Foundation and Fine-Tuned Chat Models* (the prompt
#   tokens' loss zeroed in SFT; cosine to 10%).
