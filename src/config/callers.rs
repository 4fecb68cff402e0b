//! Who may call: the `Host` names a request may carry and the browser origins
//! whose pages may call the API (`--allowed-hosts`, `--allowed-origins`).
//!
//! A page on any site can send a laptop's sluice a "simple" POST, and with DNS
//! rebinding (a name of the attacker's that resolves to 127.0.0.1) read the
//! answer too. A rebound request carries the attacker's name in `Host`, and a
//! cross-site one carries the page's `Origin`: both are refused. IP literals,
//! `localhost` (and `*.localhost`, RFC 6761), this machine's name and `--host`
//! are always allowed as hosts: no attacker controls what they resolve to.
//! (webpack-dev-server's `allowedHosts: 'auto'` draws the same line.)

use std::net::IpAddr;

/// Most names in `--allowed-hosts` or `--allowed-origins`.
pub const CALLER_NAMES_MAX: usize = 256;

#[derive(Clone, Debug, Default)]
pub struct Callers {
    any_host: bool,
    /// Lower-case names (no port); `.example.com` allows its subdomains.
    hosts: Vec<String>,
    any_origin: bool,
    /// Lower-case `scheme://host[:port]`.
    origins: Vec<String>,
}

/// The name in a `Host` value (`name`, `name:port`, `[v6]:port`), lower-case.
fn host_name(host: &str) -> Option<String> {
    let host = host.trim();
    let name = if let Some(rest) = host.strip_prefix('[') {
        let end = rest.find(']')?;
        let after = &rest[end + 1..];
        if !(after.is_empty() || after.strip_prefix(':').is_some_and(is_port)) {
            return None;
        }
        // Brackets kept: "[::1]" is an IPv6 literal.
        &host[..end + 2]
    } else {
        match host.rsplit_once(':') {
            Some((name, port)) if is_port(port) => name,
            Some(_) => return None,
            None => host,
        }
    };
    if name.is_empty() {
        return None;
    }
    Some(name.to_ascii_lowercase())
}

fn is_port(p: &str) -> bool {
    !p.is_empty() && p.len() <= 5 && p.bytes().all(|b| b.is_ascii_digit())
}

fn is_ip_literal(name: &str) -> bool {
    if let Some(v6) = name.strip_prefix('[').and_then(|n| n.strip_suffix(']')) {
        return v6.parse::<std::net::Ipv6Addr>().is_ok();
    }
    name.parse::<IpAddr>().is_ok()
}

/// An origin as browsers send it: `scheme://host[:port]`, lower-case, no path.
fn normal_origin(origin: &str) -> Option<String> {
    let o = origin.trim().trim_end_matches('/').to_ascii_lowercase();
    let (scheme, rest) = o.split_once("://")?;
    if !matches!(scheme, "http" | "https") || rest.is_empty() || rest.contains('/') {
        return None;
    }
    host_name(rest)?;
    Some(o)
}

impl Callers {
    /// From the flags; `bind_host` is `--host`, `machine` this machine's name.
    pub fn parse(
        bind_host: &str,
        hosts: &str,
        origins: &str,
        machine: Option<&str>,
    ) -> Result<Callers, String> {
        let list = |s: &str| -> Vec<String> {
            s.split(',')
                .map(|x| x.trim().to_ascii_lowercase())
                .filter(|x| !x.is_empty())
                .collect()
        };
        let mut c = Callers::default();
        for h in list(hosts) {
            if h == "*" {
                c.any_host = true;
            } else if h.trim_start_matches('.').is_empty()
                || h.contains(['/', ' ', ':'])
                || h.starts_with('[')
            {
                return Err(format!(
                    "--allowed-hosts: '{h}' is not a host name (give names without ports, '.example.com' for its subdomains, or '*')"
                ));
            } else {
                c.hosts.push(h);
            }
        }
        for o in list(origins) {
            if o == "*" {
                c.any_origin = true;
            } else {
                let n = normal_origin(&o).ok_or_else(|| {
                    format!("--allowed-origins: '{o}' is not an origin like http://localhost:3000")
                })?;
                c.origins.push(n);
            }
        }
        if c.hosts.len() > CALLER_NAMES_MAX || c.origins.len() > CALLER_NAMES_MAX {
            return Err(format!(
                "--allowed-hosts and --allowed-origins take at most {CALLER_NAMES_MAX} names each"
            ));
        }
        for name in [Some(bind_host), machine].into_iter().flatten() {
            let name = name.trim().to_ascii_lowercase();
            if !name.is_empty() && !is_ip_literal(&name) && !c.hosts.contains(&name) {
                c.hosts.push(name.clone());
                // A machine's short name is also reached as name.local (mDNS).
                if !name.contains('.') {
                    c.hosts.push(format!("{name}.local"));
                }
            }
        }
        Ok(c)
    }

    /// Whether a request whose `Host` is `host` is served.
    pub fn host_allowed(&self, host: &str) -> bool {
        if self.any_host {
            return true;
        }
        let Some(name) = host_name(host) else {
            return false;
        };
        if is_ip_literal(&name) || name == "localhost" || name.ends_with(".localhost") {
            return true;
        }
        let name = name.trim_end_matches('.');
        self.hosts.iter().any(|h| {
            if let Some(suffix) = h.strip_prefix('.') {
                name == suffix || name.ends_with(h.as_str())
            } else {
                name == h
            }
        })
    }

    /// Whether a request from a page of `origin` is served: a listed origin,
    /// or the server's own (the `Host` the request was sent to, already
    /// checked). Cross-origin ones get CORS headers; see `is_cross_origin`.
    pub fn origin_allowed(&self, origin: &str, host: &str) -> bool {
        if self.any_origin || !self.is_cross_origin(origin, host) {
            return true;
        }
        normal_origin(origin).is_some_and(|o| self.origins.contains(&o))
    }

    /// Whether `origin` is another origin than the server's own at `host`.
    pub fn is_cross_origin(&self, origin: &str, host: &str) -> bool {
        let own = format!("http://{}", host.trim().to_ascii_lowercase());
        normal_origin(origin).is_none_or(|o| o != own)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn callers(hosts: &str, origins: &str) -> Callers {
        Callers::parse("127.0.0.1", hosts, origins, Some("edgebox")).unwrap()
    }

    #[test]
    fn ip_literals_localhost_and_the_machine_are_always_allowed() {
        let c = callers("", "");
        for h in [
            "127.0.0.1:8080",
            "127.0.0.1",
            "[::1]:8080",
            "192.168.1.20:8080",
            "localhost:8080",
            "LOCALHOST",
            "app.localhost:8080",
            "edgebox:8080",
            "edgebox.local",
        ] {
            assert!(c.host_allowed(h), "{h}");
        }
    }

    #[test]
    fn other_names_are_refused_unless_listed() {
        let c = callers("", "");
        for h in [
            "attacker.example",
            "attacker.example:8080",
            "127.0.0.1.nip.io",
            "localhost.attacker.example",
            "",
            "[::1",
            "a:b:c",
            "x:99999999",
        ] {
            assert!(!c.host_allowed(h), "{h}");
        }
        let c = callers("llm.internal, .corp.example", "");
        assert!(c.host_allowed("llm.internal:8080"));
        assert!(c.host_allowed("a.corp.example"));
        assert!(c.host_allowed("corp.example"));
        assert!(!c.host_allowed("evilcorp.example"));
        assert!(callers("*", "").host_allowed("anything.example"));
    }

    #[test]
    fn a_bound_name_is_allowed() {
        let c = Callers::parse("llm.lan", "", "", None).unwrap();
        assert!(c.host_allowed("llm.lan:8080"));
        assert!(!c.host_allowed("other.lan:8080"));
    }

    #[test]
    fn origins_are_the_servers_own_or_listed() {
        let c = callers("", "http://localhost:3000");
        assert!(c.origin_allowed("http://127.0.0.1:8080", "127.0.0.1:8080"));
        assert!(!c.is_cross_origin("http://127.0.0.1:8080", "127.0.0.1:8080"));
        assert!(c.origin_allowed("http://localhost:3000", "127.0.0.1:8080"));
        assert!(c.origin_allowed("HTTP://LOCALHOST:3000/", "127.0.0.1:8080"));
        assert!(c.is_cross_origin("http://localhost:3000", "127.0.0.1:8080"));
        for o in [
            "http://evil.example",
            "http://localhost:3001",
            "null",
            "file://",
            "",
        ] {
            assert!(!c.origin_allowed(o, "127.0.0.1:8080"), "{o}");
        }
        assert!(callers("", "*").origin_allowed("http://evil.example", "127.0.0.1:8080"));
    }

    #[test]
    fn bad_flags_are_refused() {
        assert!(Callers::parse("127.0.0.1", "a.example:8080", "", None).is_err());
        assert!(Callers::parse("127.0.0.1", "", "localhost:3000", None).is_err());
        assert!(Callers::parse("127.0.0.1", "", "ftp://x", None).is_err());
        assert!(Callers::parse("127.0.0.1", ".", "", None).is_err());
    }
}
