//! A completion request turned into jobs (one per choice) through the
//! intake (`intake`): the body validated, the prompt templated and
//! tokenized, `max_tokens` fitted to the context, the bucket charged for what
//! the prefix cache does not hold; then the reply folded from the engine's
//! events (`reply`) and the bucket settled with what was used.

use super::error::ApiError;
use super::intake::{json_body, Ask, Intake};
use super::validation::{self, Api, Format, Input, ValidRequest};
use super::{openai, reply, AppState};
use crate::admission::{GenParams, Job, Task};
use crate::ffi::{SamplingParams, Token};
use crate::grammar::Constraint;
use crate::priority::Class;
use crate::stream::{CancelFlag, Event};
use crossbeam_channel::Receiver;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};
use tiny_http::Request;

pub(super) fn generate(state: &AppState, req: Request, api: Api) {
    let Some((mut intake, mut req)) = Intake::open(state, req) else {
        return;
    };
    let read = intake.read(&mut req, |req, ask| {
        let (valid, prompt) = prepare(state, req, api)?;
        let (gen, prompt) = gen_params(state, &valid, ask.class, prompt)?;
        Ok((valid, gen, prompt))
    });
    let (ask, (valid, gen, prompt)) = match read {
        Ok(r) => r,
        Err(e) => return intake.invalid(req, e),
    };
    let prompt_tokens = prompt.len();
    // Prompt tokens the prefix cache holds are not prefilled, and not charged
    // (the engine decides again at start; the bucket is settled with what it
    // really reused once the request ends, below).
    let cached_estimate = if gen.echo_logprobs {
        0
    } else {
        state.queue.reusable(&prompt)
    };
    // The client's bucket pays for the work the request may ask for: each
    // choice is a sequence of its own.
    let n = valid.n;
    let cost = (n * (prompt_tokens - cached_estimate + gen.max_tokens)) as u64;
    let mut bucket = match intake.charge(ask.class, cost) {
        Ok(b) => b,
        Err(e) => return intake.fail(req, e),
    };
    let max_tokens = gen.max_tokens;
    let (id, jobs, rxs, cancels) = choices(&intake, &req, &ask, gen, prompt, n, cached_estimate);
    // All of them or none: a refused request leaves nothing in the queue.
    // Refused for overload, not for the client's spending: the whole charge
    // goes back (`bucket` drops with all of it unused).
    if let Err(e) = intake.submit(jobs) {
        return intake.fail(req, e);
    }
    let echo_text = valid.echo.then(|| match &valid.input {
        Input::Text(t) => t.clone(),
        Input::Tokens(ids) => state.prompter.detokenize(ids),
        _ => String::new(),
    });
    let id_str = match api {
        Api::Chat => format!("chatcmpl-{:x}-{id}", state.started_unix_s),
        Api::Completions => format!("cmpl-{:x}-{id}", state.started_unix_s),
    };
    let meta = openai::Meta {
        id: &id_str,
        created: unix_now(),
        model: &state.cfg.model_name,
        api,
        include_usage: valid.include_usage,
    };
    let mut waiter = intake.waiter(&ask, rxs, cancels);
    waiter.set_paced(valid.stream);
    let mut outcome = reply::reply(req, &meta, &valid, echo_text, &waiter);
    // The prompt was charged and taken; the tokens not generated go back,
    // and so does the difference between the cached tokens expected and
    // those reused, once the engine has said (its End event).
    if let Some(b) = &mut bucket {
        b.unused = (n * max_tokens).saturating_sub(outcome.usage.completion_tokens) as u64;
        if outcome.usage.prompt_tokens > 0 {
            let reused = outcome.cached_all;
            let expected = n * cached_estimate;
            b.unused += reused.saturating_sub(expected) as u64;
            let more = expected.saturating_sub(reused) as u64;
            state.limiter.debit(b.id, b.limit, more);
        }
    }
    if outcome.usage.prompt_tokens == 0 {
        outcome.usage.prompt_tokens = prompt_tokens;
    }
    intake.log(&outcome);
}

/// One job per choice, each with its own events and cancel flag; a choice
/// after the first samples with the next seed. Returns the first job's id.
fn choices(
    intake: &Intake,
    req: &Request,
    ask: &Ask,
    gen: GenParams,
    prompt: Vec<Token>,
    n: usize,
    cached_estimate: usize,
) -> (u64, Vec<Job>, Vec<Receiver<Event>>, Vec<CancelFlag>) {
    let state = intake.state;
    let id = state.next_id.fetch_add(1, Ordering::Relaxed);
    let echo_logprobs = gen.echo_logprobs;
    let prompt_tokens = prompt.len();
    let request_id: Arc<str> = super::request_id(req).into();
    let mut rxs = Vec::with_capacity(n);
    let mut cancels: Vec<CancelFlag> = Vec::with_capacity(n);
    let mut jobs = Vec::with_capacity(n);
    for i in 0..n {
        let (tx, rx, cancel) = intake.channel();
        let mut gen = gen.clone();
        gen.sampling.seed = gen.sampling.seed.wrapping_add(i as u32);
        let job = Job {
            id: if i == 0 {
                id
            } else {
                state.next_id.fetch_add(1, Ordering::Relaxed)
            },
            request_id: Arc::clone(&request_id),
            class: ask.class,
            prompt: prompt.clone(),
            task: Task::Generate(Box::new(gen)),
            enqueued_at: intake.t0,
            deadline: intake.deadline(ask),
            events: tx,
            cancel: cancel.clone(),
            // A later choice takes the first one's prompt cells: admission
            // counts the one token it prefills.
            cached_estimate: match i {
                0 => cached_estimate,
                _ if echo_logprobs => cached_estimate,
                _ => cached_estimate.max(prompt_tokens - 1),
            },
            // The prompt's log-probabilities need a prefill of each.
            prompt_of: (i > 0 && !echo_logprobs).then_some(id),
        };
        jobs.push(job);
        rxs.push(rx);
        cancels.push(cancel);
    }
    (id, jobs, rxs, cancels)
}

/// Caps, reads and validates the body, and counts the prompt in tokens.
fn prepare(
    state: &AppState,
    req: &mut Request,
    api: Api,
) -> Result<(ValidRequest, Vec<Token>), ApiError> {
    let body = json_body(state, req)?;
    let valid = validation::parse(api, &body)?;
    let prompt = state
        .prompter
        .tokens(&valid.input, &valid.tools)
        .map_err(|m| ApiError::invalid(valid.input.param(), m))?;
    state
        .metrics
        .prompts_tokenized
        .fetch_add(1, Ordering::Relaxed);
    if prompt.is_empty() {
        return Err(ApiError::invalid(
            "prompt",
            "the prompt is empty (0 tokens)",
        ));
    }
    Ok((valid, prompt))
}

/// Fits max_tokens to the context and builds the engine's parameters.
fn gen_params(
    state: &AppState,
    v: &ValidRequest,
    class: Class,
    prompt: Vec<Token>,
) -> Result<(GenParams, Vec<Token>), ApiError> {
    let max_tokens = fitted_max_tokens(state, v, class, prompt.len())?;
    let seed = v.seed.unwrap_or_else(random_seed);
    let n_vocab = state.prompter.n_vocab();
    if let Some(&(bad, _)) = v
        .penalties
        .logit_bias
        .iter()
        .find(|&&(t, _)| t as usize >= n_vocab)
    {
        return Err(ApiError::invalid(
            "logit_bias",
            format!("'logit_bias' names token {bad}, outside the vocabulary of {n_vocab} tokens"),
        ));
    }
    let constraint = constraint(state, v)?;
    Ok((
        GenParams {
            max_tokens,
            sampling: SamplingParams {
                temperature: v.temperature,
                top_k: v.top_k,
                top_p: v.top_p,
                min_p: v.min_p,
                seed,
            },
            penalties: v.penalties.clone(),
            constraint,
            stop: v.stop.clone(),
            ignore_eos: v.ignore_eos,
            top_logprobs: v.top_logprobs,
            echo_logprobs: v.echo && v.top_logprobs.is_some(),
        },
        prompt,
    ))
}

/// `max_tokens` fitted to the context the request's class may use (the
/// default fills the room left, up to `--max-tokens-default`); a prompt or
/// a `max_tokens` that does not fit is a 400.
fn fitted_max_tokens(
    state: &AppState,
    v: &ValidRequest,
    class: Class,
    p: usize,
) -> Result<usize, ApiError> {
    // A batch request may not take the KV cells kept for interactive ones.
    let (n_ctx, whose) = match class {
        Class::Interactive => (state.seq_tokens_max, ""),
        Class::Batch if state.batch_seq_tokens_max < state.seq_tokens_max => (
            state.batch_seq_tokens_max,
            " of batch requests (the KV cache less the interactive slots' share)",
        ),
        Class::Batch => (state.seq_tokens_max, ""),
    };
    let scoring_only = v.echo && v.max_tokens == Some(0);
    let room = n_ctx.saturating_sub(p);
    if room == 0 && !scoring_only || p > n_ctx {
        return Err(ApiError::ContextLength {
            message: format!(
                "prompt has {p} tokens; the context limit{whose} is {n_ctx} tokens, including at least 1 to generate"
            ),
        });
    }
    match v.max_tokens {
        Some(n) if n > room => Err(ApiError::ContextLength {
            message: format!(
                "prompt has {p} tokens and max_tokens is {n}: together {} tokens, over the context limit{whose} of {n_ctx}",
                p + n
            ),
        }),
        Some(n) => Ok(n),
        None => Ok(state.cfg.max_tokens_default.min(room)),
    }
}

/// What structured output holds the answer to: the tools' call format, a
/// JSON schema or any JSON object; or nothing.
fn constraint(state: &AppState, v: &ValidRequest) -> Result<Option<Constraint>, ApiError> {
    let grammars = || {
        state.grammars.as_ref().map_err(|e| {
            ApiError::invalid(
                "response_format",
                format!("structured output is not available for this model: {e}"),
            )
        })
    };
    Ok(match &v.format {
        Format::Text if v.tools.calls() => Some(
            grammars()?
                .json_schema(&v.tools.call_schema(), v.tools.strict())
                .map_err(|e| {
                    ApiError::invalid(
                        "tools",
                        format!("a function's parameters cannot be enforced: {e}"),
                    )
                })?,
        ),
        Format::Text => None,
        _ if v.tools.calls() => {
            return Err(ApiError::invalid(
                "response_format",
                "an answer held to the tools' call format (tool_choice other than \"none\") cannot also follow response_format; send one of them",
            ))
        }
        format => {
            let grammars = grammars()?;
            Some(match format {
                Format::JsonSchema { schema, strict } => {
                    grammars.json_schema(schema, *strict).map_err(|e| {
                        ApiError::invalid(
                            "response_format.json_schema.schema",
                            format!("the schema cannot be enforced: {e}"),
                        )
                    })?
                }
                _ => grammars.json_object(),
            })
        }
    })
}

fn random_seed() -> u32 {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    nanos ^ (COUNTER.fetch_add(0x9E37_79B9, Ordering::Relaxed) as u32)
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
