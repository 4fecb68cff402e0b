//! The instruction sets this binary was compiled for, checked against the CPU
//! it runs on before anything else runs.
//!
//! A build may use any instruction its target allows, anywhere: llama.cpp's
//! kernels, and any loop the compiler vectorises. On a CPU without one of
//! them the process dies of SIGILL at a place no one can explain. So `main`
//! first asks the CPU (CPUID) for each feature the build was compiled with,
//! and refuses with a sentence naming what is missing and which build to use.
//! The Debian package is built for x86-64-v3 (AVX2, FMA, F16C, BMI1/2: every
//! x86-64 CPU since Intel Haswell, 2013, and AMD Excavator/Zen); `make build`
//! builds for the machine it runs on.

/// The features this build was compiled with that this CPU lacks.
///
/// Asked of CPUID itself: `is_x86_feature_detected!` answers "yes" without
/// asking for a feature the build was compiled with, which is the question.
pub fn missing() -> Vec<&'static str> {
    let mut missing = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        let has = cpuid_features();
        macro_rules! check {
            ($($f:tt),* $(,)?) => {
                $(
                    if cfg!(target_feature = $f) && !has.contains(&$f) {
                        missing.push($f);
                    }
                )*
            };
        }
        check!(
            "sse3",
            "ssse3",
            "sse4.1",
            "sse4.2",
            "popcnt",
            "pclmulqdq",
            "aes",
            "avx",
            "avx2",
            "fma",
            "f16c",
            "bmi1",
            "bmi2",
            "lzcnt",
            "movbe",
            "xsave",
            "rdrand",
            "rdseed",
            "adx",
            "sha",
            "gfni",
            "vaes",
            "vpclmulqdq",
            "avxvnni",
            "avx512f",
            "avx512cd",
            "avx512bw",
            "avx512dq",
            "avx512vl",
            "avx512vnni",
            "avx512bf16",
            "avx512vbmi",
            "avx512vbmi2",
            "avx512bitalg",
            "avx512vpopcntdq",
            "avx512ifma",
        );
    }
    missing
}

/// The features CPUID reports, by their names in `target_feature`. (Whether
/// the OS saves the AVX registers is not asked: every kernel that runs
/// sluice does.)
#[cfg(target_arch = "x86_64")]
fn cpuid_features() -> Vec<&'static str> {
    use crate::ffi::cpuid;
    let max_leaf = cpuid(0, 0)[0];
    let [_, _, leaf1_ecx, _] = cpuid(1, 0);
    let ([_, l7_ebx, l7_ecx, _], [l7s1_eax, ..]) = if max_leaf >= 7 {
        (cpuid(7, 0), cpuid(7, 1))
    } else {
        ([0; 4], [0; 4])
    };
    let ext = if cpuid(0x8000_0000, 0)[0] >= 0x8000_0001 {
        cpuid(0x8000_0001, 0)[2]
    } else {
        0
    };
    let bits: [(&'static str, u32, u32); 36] = [
        ("sse3", leaf1_ecx, 0),
        ("pclmulqdq", leaf1_ecx, 1),
        ("ssse3", leaf1_ecx, 9),
        ("fma", leaf1_ecx, 12),
        ("sse4.1", leaf1_ecx, 19),
        ("sse4.2", leaf1_ecx, 20),
        ("movbe", leaf1_ecx, 22),
        ("popcnt", leaf1_ecx, 23),
        ("aes", leaf1_ecx, 25),
        ("xsave", leaf1_ecx, 26),
        ("avx", leaf1_ecx, 28),
        ("f16c", leaf1_ecx, 29),
        ("rdrand", leaf1_ecx, 30),
        ("bmi1", l7_ebx, 3),
        ("avx2", l7_ebx, 5),
        ("bmi2", l7_ebx, 8),
        ("avx512f", l7_ebx, 16),
        ("avx512dq", l7_ebx, 17),
        ("rdseed", l7_ebx, 18),
        ("adx", l7_ebx, 19),
        ("avx512ifma", l7_ebx, 21),
        ("avx512cd", l7_ebx, 28),
        ("sha", l7_ebx, 29),
        ("avx512bw", l7_ebx, 30),
        ("avx512vl", l7_ebx, 31),
        ("avx512vbmi", l7_ecx, 1),
        ("avx512vbmi2", l7_ecx, 6),
        ("gfni", l7_ecx, 8),
        ("vaes", l7_ecx, 9),
        ("vpclmulqdq", l7_ecx, 10),
        ("avx512vnni", l7_ecx, 11),
        ("avx512bitalg", l7_ecx, 12),
        ("avx512vpopcntdq", l7_ecx, 14),
        ("avxvnni", l7s1_eax, 4),
        ("avx512bf16", l7s1_eax, 5),
        ("lzcnt", ext, 5),
    ];
    bits.iter()
        .filter(|(_, reg, bit)| reg & (1 << bit) != 0)
        .map(|(name, _, _)| *name)
        .collect()
}

/// The refusal when `missing` is not empty: what the build needs, what the
/// CPU lacks, and what to run instead.
pub fn refusal(missing: &[&str], target_cpu: &str) -> String {
    format!(
        "this sluice was built for target-cpu={target_cpu} and uses CPU instructions this \
         CPU does not have: {}. It would die of an illegal instruction, so it stops here. \
         Use a build for this CPU (`make build` compiles for the machine it runs on), or the \
         Debian package (`make deb`), built for x86-64-v3: any x86-64 CPU with AVX2, FMA \
         and F16C (Intel since Haswell, AMD since Excavator).",
        missing.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_machine_that_built_the_tests_runs_them() {
        // The test binary runs on the CPU it was built for (or one with more).
        assert_eq!(missing(), Vec::<&str>::new());
    }

    #[test]
    fn the_refusal_names_what_is_missing_and_the_way_out() {
        let text = refusal(&["avx2", "fma"], "x86-64-v3");
        assert!(text.contains("avx2, fma"), "{text}");
        assert!(text.contains("target-cpu=x86-64-v3"), "{text}");
        assert!(text.contains("make build"), "{text}");
    }
}
