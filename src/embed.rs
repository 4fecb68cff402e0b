//! Embeddings: which token states make a text's vector (`Pooling`, from the
//! GGUF or `--pooling`), and the pooling itself, fed chunk by chunk as the
//! engine prefills an input (`Pooler`). The vector is L2-normalized, as
//! OpenAI's are.

/// How one input's token states become its vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    /// The mean of every token's state.
    Mean,
    /// The first token's state.
    Cls,
    /// The last token's state (a decoder's summary of the whole input).
    Last,
}

impl Pooling {
    pub fn name(self) -> &'static str {
        match self {
            Pooling::Mean => "mean",
            Pooling::Cls => "cls",
            Pooling::Last => "last",
        }
    }

    pub fn from_name(v: &str) -> Option<Pooling> {
        match v {
            "mean" => Some(Pooling::Mean),
            "cls" => Some(Pooling::Cls),
            "last" => Some(Pooling::Last),
            _ => None,
        }
    }

    /// llama.cpp's `{arch}.pooling_type` GGUF value: 1 mean, 2 cls, 3 last
    /// (0 none and 4 rank, a reranker's score, make no embedding).
    pub fn from_gguf(v: &str) -> Option<Pooling> {
        match v.trim() {
            "1" => Some(Pooling::Mean),
            "2" => Some(Pooling::Cls),
            "3" => Some(Pooling::Last),
            _ => None,
        }
    }

    /// Whether the state of the token at `pos` of an input of `len` tokens
    /// is part of its vector.
    pub fn wants(self, pos: usize, len: usize) -> bool {
        match self {
            Pooling::Mean => true,
            Pooling::Cls => pos == 0,
            Pooling::Last => pos + 1 == len,
        }
    }
}

/// An embedding request's inputs, as the engine runs them: one after the
/// other in one sequence, whose cells are cleared between them.
#[derive(Debug, Clone, PartialEq)]
pub struct EmbedSpec {
    /// Where each input ends in the job's prompt (the inputs' tokens, one
    /// after another): increasing, the last one the prompt's length.
    pub ends: Vec<usize>,
    pub pooling: Pooling,
}

impl EmbedSpec {
    /// The input the prompt token at `at` belongs to, and that input's start
    /// and end in the prompt.
    pub fn input_at(&self, at: usize) -> (usize, usize, usize) {
        let i = self.ends.partition_point(|&end| end <= at);
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        (i, start, self.ends[i])
    }

    /// Tokens of the longest input: the KV cells the job holds at most.
    pub fn longest(&self) -> usize {
        let mut start = 0;
        let mut longest = 0;
        for &end in &self.ends {
            longest = longest.max(end - start);
            start = end;
        }
        longest
    }
}

/// One input's vector in the making: token states summed (mean) or kept
/// (cls, last) as they are decoded.
#[derive(Debug, Clone, Default)]
pub struct Pooler {
    sum: Vec<f64>,
    n: usize,
}

impl Pooler {
    /// Adds the state of a token that `Pooling::wants`.
    pub fn add(&mut self, state: &[f32]) {
        if self.sum.is_empty() {
            self.sum = vec![0.0; state.len()];
        }
        assert_eq!(self.sum.len(), state.len(), "states of one width");
        for (s, &x) in self.sum.iter_mut().zip(state) {
            *s += f64::from(x);
        }
        self.n += 1;
    }

    /// The vector: the states' mean, scaled to length 1 (a zero vector stays
    /// zero). Resets the pooler for the next input.
    pub fn finish(&mut self) -> Vec<f32> {
        let n = self.n.max(1) as f64;
        let mean: Vec<f64> = self.sum.iter().map(|s| s / n).collect();
        let norm = mean.iter().map(|x| x * x).sum::<f64>().sqrt();
        let scale = if norm > 0.0 { 1.0 / norm } else { 0.0 };
        *self = Pooler::default();
        mean.iter().map(|x| (x * scale) as f32).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mean_pooling_is_the_normalized_mean() {
        let mut p = Pooler::default();
        p.add(&[1.0, 0.0]);
        p.add(&[3.0, 4.0]);
        // mean (2, 2) -> (1/sqrt 2, 1/sqrt 2)
        let v = p.finish();
        assert!((v[0] - std::f32::consts::FRAC_1_SQRT_2).abs() < 1e-6);
        assert!((v[1] - std::f32::consts::FRAC_1_SQRT_2).abs() < 1e-6);
        // Reset: the next input starts from nothing.
        p.add(&[0.0, -2.0]);
        assert_eq!(p.finish(), vec![0.0, -1.0]);
    }

    #[test]
    fn a_zero_state_stays_zero() {
        let mut p = Pooler::default();
        p.add(&[0.0, 0.0, 0.0]);
        assert_eq!(p.finish(), vec![0.0; 3]);
    }

    #[test]
    fn pooling_picks_its_tokens() {
        let picked = |p: Pooling| (0..4).filter(|&i| p.wants(i, 4)).collect::<Vec<_>>();
        assert_eq!(picked(Pooling::Mean), vec![0, 1, 2, 3]);
        assert_eq!(picked(Pooling::Cls), vec![0]);
        assert_eq!(picked(Pooling::Last), vec![3]);
        assert_eq!(Pooling::from_gguf("3"), Some(Pooling::Last));
        assert_eq!(Pooling::from_gguf("0"), None);
        assert_eq!(Pooling::from_gguf("4"), None);
    }

    #[test]
    fn inputs_are_found_by_position() {
        let spec = EmbedSpec {
            ends: vec![3, 4, 9],
            pooling: Pooling::Mean,
        };
        assert_eq!(spec.input_at(0), (0, 0, 3));
        assert_eq!(spec.input_at(2), (0, 0, 3));
        assert_eq!(spec.input_at(3), (1, 3, 4));
        assert_eq!(spec.input_at(4), (2, 4, 9));
        assert_eq!(spec.input_at(8), (2, 4, 9));
        assert_eq!(spec.longest(), 5);
    }
}
