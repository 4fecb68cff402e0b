//! What each simulated client asks for and how it behaves.
//!
//! A workload mixes ordinary chat requests with long prompts (near the context
//! length), slow readers (a read rate in tokens per second) and clients that
//! hang up after N tokens. It comes from flags or from a small JSON file whose
//! keys are the flag names with `_` (e.g. `{"prompt_tokens": "uniform:20:200",
//! "slow_share": 0.2}`).

use crate::arrivals::Rng;
use serde_json::Value;
use std::time::Duration;

/// A distribution of token counts: `fixed:N`, `uniform:LO:HI` or `exp:MEAN`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Dist {
    Fixed(u64),
    Uniform(u64, u64),
    Exp(f64),
    /// Log-normal with this median and shape (σ of the log), clamped to
    /// `[lo, hi]`: request sizes as they arrive at a real service, most
    /// small and a long tail.
    LogNormal {
        median: f64,
        sigma: f64,
        lo: u64,
        hi: u64,
    },
}

/// Exponential draws are capped at this multiple of their mean.
const EXP_CAP_MEANS: f64 = 8.0;

impl Dist {
    pub fn parse(s: &str) -> Result<Dist, String> {
        let parts: Vec<&str> = s.split(':').collect();
        let num = |p: &str| {
            p.parse::<u64>()
                .map_err(|_| format!("'{p}' in '{s}' is not a whole number"))
        };
        match parts.as_slice() {
            [n] => Ok(Dist::Fixed(num(n)?)),
            ["fixed", n] => Ok(Dist::Fixed(num(n)?)),
            ["uniform", lo, hi] => {
                let (lo, hi) = (num(lo)?, num(hi)?);
                if lo > hi {
                    return Err(format!("'{s}': low end above high end"));
                }
                Ok(Dist::Uniform(lo, hi))
            }
            ["exp", mean] => {
                let m: f64 = mean
                    .parse()
                    .map_err(|_| format!("'{mean}' in '{s}' is not a number"))?;
                if m.is_finite() && m > 0.0 {
                    Ok(Dist::Exp(m))
                } else {
                    Err(format!("'{s}': the mean must be positive"))
                }
            }
            ["lognormal", median, sigma, lo, hi] => {
                let f = |p: &str| {
                    p.parse::<f64>()
                        .map_err(|_| format!("'{p}' in '{s}' is not a number"))
                };
                let (median, sigma, lo, hi) = (f(median)?, f(sigma)?, num(lo)?, num(hi)?);
                if !(median > 0.0 && sigma >= 0.0 && median.is_finite() && sigma.is_finite())
                    || lo > hi
                {
                    return Err(format!(
                        "'{s}': the median must be positive, sigma not negative, LO <= HI"
                    ));
                }
                Ok(Dist::LogNormal {
                    median,
                    sigma,
                    lo,
                    hi,
                })
            }
            _ => Err(format!(
                "'{s}': expected fixed:N, uniform:LO:HI, exp:MEAN or lognormal:MEDIAN:SIGMA:LO:HI"
            )),
        }
    }

    pub fn sample(&self, rng: &mut Rng) -> u64 {
        match *self {
            Dist::Fixed(n) => n,
            Dist::Uniform(lo, hi) => rng.range(lo, hi),
            Dist::Exp(mean) => rng.exp(mean).min(mean * EXP_CAP_MEANS).round().max(1.0) as u64,
            Dist::LogNormal {
                median,
                sigma,
                lo,
                hi,
            } => {
                // Box-Muller: a standard normal from two uniforms.
                let u1 = rng.next_f64().max(f64::MIN_POSITIVE);
                let u2 = rng.next_f64();
                let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
                ((median * (sigma * z).exp()).round() as u64).clamp(lo.max(1), hi.max(1))
            }
        }
    }
}

/// What a client does after a 429 or 503.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Retry {
    /// Take the refusal as the answer.
    None,
    /// Wait `Retry-After` (plus up to 50% jitter, at most `cap`), then try again,
    /// at most `max` times.
    RetryAfter { max: u32, cap: Duration },
}

impl Retry {
    pub fn parse(s: &str, max: u32, cap: Duration) -> Result<Retry, String> {
        match s {
            "none" => Ok(Retry::None),
            "retry-after" => Ok(Retry::RetryAfter { max, cap }),
            _ => Err(format!("retry policy '{s}': expected none or retry-after")),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Workload {
    pub prompt_tokens: Dist,
    pub max_tokens: Dist,
    /// Share of requests with a long prompt of `long_prompt_tokens`.
    pub long_share: f64,
    pub long_prompt_tokens: u64,
    /// Share of clients that read at `slow_read_tok_s`.
    pub slow_share: f64,
    pub slow_read_tok_s: f64,
    /// Share of clients that hang up after `disconnect_after_tokens` tokens.
    pub disconnect_share: f64,
    pub disconnect_after_tokens: u64,
    /// A client gives up after this long (counted as a timeout).
    pub timeout: Duration,
    pub retry: Retry,
    /// Every request sends the same prompt text (of the first draw's length):
    /// what a server's prompt cache can serve, unlike fresh prompts.
    pub repeat_prompt: bool,
}

/// The text seed of every request when prompts repeat.
const REPEATED_TEXT_SEED: u64 = 1;

/// How one client reads its stream.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Reader {
    /// As fast as the server sends.
    Fast,
    /// One token per `1 / tok_s` seconds.
    Slow { tok_s: f64 },
    /// Hangs up after this many tokens.
    Disconnect { after_tokens: u64 },
}

/// One request as the workload draws it.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestSpec {
    pub prompt_tokens: u64,
    pub max_tokens: u64,
    pub long: bool,
    pub reader: Reader,
    /// Seed for the prompt text, so that prompts differ between requests.
    pub text_seed: u64,
}

impl Workload {
    pub fn draw(&self, rng: &mut Rng) -> RequestSpec {
        let long = rng.chance(self.long_share);
        let prompt_tokens = if long {
            self.long_prompt_tokens
        } else if self.repeat_prompt {
            let mut first = Rng::new(REPEATED_TEXT_SEED);
            self.prompt_tokens.sample(&mut first)
        } else {
            self.prompt_tokens.sample(rng)
        };
        let roll = rng.next_f64();
        let reader = if roll < self.slow_share {
            Reader::Slow {
                tok_s: self.slow_read_tok_s,
            }
        } else if roll < self.slow_share + self.disconnect_share {
            Reader::Disconnect {
                after_tokens: self.disconnect_after_tokens,
            }
        } else {
            Reader::Fast
        };
        RequestSpec {
            prompt_tokens,
            max_tokens: self.max_tokens.sample(rng).max(1),
            long,
            reader,
            text_seed: match rng.next_u64() {
                _ if self.repeat_prompt => REPEATED_TEXT_SEED,
                seed => seed,
            },
        }
    }

    /// Applies the keys present in a JSON object on top of this workload.
    pub fn apply_json(&mut self, v: &Value) -> Result<(), String> {
        let obj = v
            .as_object()
            .ok_or("the workload file must hold a JSON object")?;
        for (k, val) in obj {
            let num = || val.as_f64().ok_or(format!("'{k}' must be a number"));
            let share = || {
                let x = num()?;
                if (0.0..=1.0).contains(&x) {
                    Ok(x)
                } else {
                    Err(format!("'{k}' is a share: 0 to 1"))
                }
            };
            let dist = || {
                Dist::parse(
                    val.as_str()
                        .ok_or(format!("'{k}' must be a string like \"uniform:16:128\""))?,
                )
            };
            match k.as_str() {
                "prompt_tokens" => self.prompt_tokens = dist()?,
                "max_tokens" => self.max_tokens = dist()?,
                "long_share" => self.long_share = share()?,
                "long_prompt_tokens" => self.long_prompt_tokens = num()? as u64,
                "slow_share" => self.slow_share = share()?,
                "slow_read_tok_s" => self.slow_read_tok_s = num()?,
                "disconnect_share" => self.disconnect_share = share()?,
                "disconnect_after_tokens" => self.disconnect_after_tokens = num()? as u64,
                "timeout_s" => self.timeout = Duration::from_secs_f64(num()?),
                other => return Err(format!("unknown workload key '{other}'")),
            }
        }
        self.check()
    }

    pub fn check(&self) -> Result<(), String> {
        if self.slow_share + self.disconnect_share > 1.0 {
            return Err("slow_share + disconnect_share must not exceed 1".into());
        }
        if self.slow_share > 0.0 && self.slow_read_tok_s <= 0.0 {
            return Err("slow_read_tok_s must be positive".into());
        }
        if self.timeout.is_zero() {
            return Err("the client timeout must be positive".into());
        }
        Ok(())
    }
}

/// About `tokens` tokens of varied text (counted for SmolLM2's tokenizer; other
/// tokenizers land within a few tens of percent). Each line is ~20 tokens.
pub fn prompt_text(tokens: u64, seed: u64) -> String {
    const ANIMALS: [&str; 8] = [
        "fox", "cat", "owl", "horse", "otter", "crow", "lynx", "mole",
    ];
    const COLORS: [&str; 6] = ["red", "blue", "green", "amber", "grey", "violet"];
    const TOKENS_PER_LINE: u64 = 20;
    let mut rng = Rng::new(seed);
    let lines = tokens.div_ceil(TOKENS_PER_LINE).max(1);
    let mut out = String::with_capacity(lines as usize * 64);
    for i in 0..lines {
        let a = ANIMALS[rng.range(0, 7) as usize];
        let c = COLORS[rng.range(0, 5) as usize];
        out.push_str(&format!(
            "Line {i}: the {a} jumped over the {c} fence near house {}.\n",
            rng.range(1, 999)
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> Workload {
        Workload {
            prompt_tokens: Dist::Fixed(50),
            max_tokens: Dist::Fixed(32),
            long_share: 0.0,
            long_prompt_tokens: 7000,
            slow_share: 0.0,
            slow_read_tok_s: 5.0,
            disconnect_share: 0.0,
            disconnect_after_tokens: 4,
            timeout: Duration::from_secs(60),
            retry: Retry::None,
            repeat_prompt: false,
        }
    }

    #[test]
    fn distributions_parse_and_stay_in_range() {
        assert_eq!(Dist::parse("64"), Ok(Dist::Fixed(64)));
        assert_eq!(Dist::parse("uniform:16:128"), Ok(Dist::Uniform(16, 128)));
        assert!(Dist::parse("lognormal:200:1.2:5:4000").is_ok());
        assert!(Dist::parse("lognormal:0:1:5:4000").is_err());
        assert!(Dist::parse("lognormal:200:1:500:40").is_err());
        let d = Dist::parse("lognormal:200:1.2:5:4000").unwrap();
        let mut rng = Rng::new(7);
        let mut v: Vec<u64> = (0..4001).map(|_| d.sample(&mut rng)).collect();
        v.sort_unstable();
        assert!(v[0] >= 5 && v[4000] <= 4000);
        // The median of the draws is near the distribution's (within 15 %).
        assert!((170..=230).contains(&v[2000]), "median {}", v[2000]);
        assert!(Dist::parse("uniform:9:1").is_err());
        assert!(Dist::parse("exp:-3").is_err());
        assert!(Dist::parse("normal:3").is_err());
        let mut rng = Rng::new(1);
        for _ in 0..1000 {
            let n = Dist::Uniform(16, 128).sample(&mut rng);
            assert!((16..=128).contains(&n));
            let e = Dist::Exp(100.0).sample(&mut rng);
            assert!((1..=800).contains(&e));
        }
    }

    #[test]
    fn shares_of_client_kinds_are_drawn_as_configured() {
        let mut w = base();
        w.apply_json(
            &serde_json::json!({"slow_share": 0.2, "disconnect_share": 0.3, "long_share": 0.1}),
        )
        .unwrap();
        let mut rng = Rng::new(9);
        let specs: Vec<RequestSpec> = (0..20_000).map(|_| w.draw(&mut rng)).collect();
        let share = |f: &dyn Fn(&RequestSpec) -> bool| {
            specs.iter().filter(|s| f(s)).count() as f64 / specs.len() as f64
        };
        assert!((share(&|s| matches!(s.reader, Reader::Slow { .. })) - 0.2).abs() < 0.015);
        assert!((share(&|s| matches!(s.reader, Reader::Disconnect { .. })) - 0.3).abs() < 0.015);
        assert!((share(&|s| s.long) - 0.1).abs() < 0.01);
        assert!(specs
            .iter()
            .filter(|s| s.long)
            .all(|s| s.prompt_tokens == 7000));
    }

    #[test]
    fn bad_workload_files_are_refused() {
        let mut w = base();
        assert!(w.apply_json(&serde_json::json!({"slow_share": 2})).is_err());
        assert!(w.apply_json(&serde_json::json!({"colour": 1})).is_err());
        assert!(w
            .apply_json(&serde_json::json!({"slow_share": 0.7, "disconnect_share": 0.7}))
            .is_err());
    }

    #[test]
    fn repeated_prompts_are_one_prompt() {
        let mut w = base();
        w.prompt_tokens = Dist::Uniform(20, 200);
        w.repeat_prompt = true;
        let mut rng = Rng::new(3);
        let a = w.draw(&mut rng);
        let b = w.draw(&mut rng);
        assert_eq!(
            (a.prompt_tokens, a.text_seed),
            (b.prompt_tokens, b.text_seed)
        );
        w.repeat_prompt = false;
        assert_ne!(w.draw(&mut rng).text_seed, w.draw(&mut rng).text_seed);
    }

    #[test]
    fn prompt_text_has_about_the_asked_length_and_varies() {
        let t = prompt_text(200, 1);
        assert_eq!(t.lines().count(), 10);
        assert_ne!(prompt_text(200, 1), prompt_text(200, 2));
    }
}
