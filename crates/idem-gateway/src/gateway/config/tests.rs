use super::*;

/// Whether `pattern` matches `path` once the path is in normal form.
fn matches(pattern: &PathPattern, path: &str) -> bool {
    crate::gateway::path::normalize(path).is_ok_and(|p| pattern.matches(&p))
}

#[test]
fn patterns() {
    let p = PathPattern::parse("/v1/orders/*/capture").unwrap();
    assert!(matches(&p, "/v1/orders/42/capture"));
    assert!(matches(&p, "/v1/orders/42/capture/"));
    assert!(matches(&p, "/v1/orders//42/capture"));
    assert!(matches(&p, "//v1/%6Frders/42/capture"));
    assert!(matches(&p, "/v1/./orders/x/../42/capture"));
    assert!(!matches(&p, "/v1/orders//capture"));
    assert!(!matches(&p, "/v1/orders/42"));
    assert!(!matches(&p, "/v1/orders/42/capture/x"));
    assert!(!matches(&p, "/V1/orders/42/capture"));
    assert!(p.case_sensitive(false).matches("/V1/ORDERS/42/Capture"));
    let any = PathPattern::parse("/v1/**").unwrap();
    assert!(matches(&any, "/v1"));
    assert!(matches(&any, "/v1/a/b/c"));
    assert!(!matches(&any, "/v2/a"));
    assert!(!matches(&any, "/v1/.."));
    assert!(
        PathPattern::parse("/**")
            .unwrap()
            .matches("/anything/at/all")
    );
    assert!(PathPattern::parse("/exact").unwrap().matches("/exact"));
    // a pattern may spell a segment with percent-encodings; both sides are compared decoded
    let cafe = PathPattern::parse("/caf%c3%a9/%21").unwrap();
    assert!(matches(&cafe, "/caf\u{e9}/!"));
    assert!(matches(&cafe, "/caf%C3%A9/%21"));
    for bad in [
        "v1", "/a/**/b", "/a//b", "/a/./b", "/a/../b", "/a/%2e", "/a%2Fb", "/a;b", "/a/%zz",
    ] {
        assert!(PathPattern::parse(bad).is_err(), "{bad}");
    }
}

mod spellings {
    use super::super::PathPattern;
    use crate::gateway::path::normalize;
    use proptest::prelude::*;

    const ROUTES: [&str; 5] = [
        "/v1/payments/**",
        "/v1/orders/*/capture",
        "/v1/orders",
        "/a/*/b",
        "/b/**",
    ];

    /// The index of the first route matching `path` (in normal form), if any.
    fn route_of(path: &str) -> Option<usize> {
        ROUTES
            .iter()
            .position(|r| PathPattern::parse(r).unwrap().matches(path))
    }

    /// How the most lenient common upstream reads a path: every percent-encoding
    /// decoded (an encoded slash splits), `\` taken for `/`, `;` parameters stripped,
    /// empty segments dropped and dot segments resolved, clamping at the root.
    fn lenient(raw: &str) -> String {
        let mut bytes = crate::gateway::path::decoded(raw);
        for b in &mut bytes {
            if *b == b'\\' {
                *b = b'/';
            }
        }
        let mut segments: Vec<&[u8]> = Vec::new();
        for seg in bytes.split(|&b| b == b'/') {
            let seg = seg.split(|&b| b == b';').next().unwrap_or_default();
            match seg {
                b"" | b"." => {}
                b".." => {
                    segments.pop();
                }
                s => segments.push(s),
            }
        }
        let mut out = String::new();
        for s in segments {
            out.push('/');
            for &b in s {
                out.push_str(&format!("%{b:02X}"));
            }
        }
        if out.is_empty() { "/".into() } else { out }
    }

    /// What is put before a segment (or done to it) when spelling it.
    #[derive(Debug, Clone)]
    enum Twist {
        None,
        /// `./`
        Dot,
        /// `x/../`
        Up(String),
        /// `//`
        Double,
        /// `%2e/` or `%2E%2E/` after a detour: refused.
        EncodedDot(bool),
        /// `;x` after the segment: refused.
        Param,
        /// `%2F` or `\` inside the segment: refused.
        Separator(bool),
    }

    impl Twist {
        fn refused(&self) -> bool {
            matches!(self, Self::EncodedDot(_) | Self::Param | Self::Separator(_))
        }
    }

    fn segment() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("v1".to_owned()),
            Just("payments".to_owned()),
            Just("orders".to_owned()),
            Just("capture".to_owned()),
            Just("a".to_owned()),
            Just("b".to_owned()),
            "[a-zA-Z0-9._~-]{1,6}".prop_filter("not a dot segment", |s| s != "." && s != ".."),
        ]
    }

    fn twist() -> impl Strategy<Value = Twist> {
        prop_oneof![
            6 => Just(Twist::None),
            2 => Just(Twist::Dot),
            2 => "[a-z]{1,3}".prop_map(Twist::Up),
            2 => Just(Twist::Double),
            1 => any::<bool>().prop_map(Twist::EncodedDot),
            1 => Just(Twist::Param),
            1 => any::<bool>().prop_map(Twist::Separator),
        ]
    }

    /// A segment with some of its characters percent-encoded, hex in either case.
    fn spell_segment(seg: &str, encode: u64, lower: bool) -> String {
        seg.bytes()
            .enumerate()
            .map(|(i, b)| {
                if encode >> (i % 64) & 1 == 1 {
                    if lower {
                        format!("%{b:02x}")
                    } else {
                        format!("%{b:02X}")
                    }
                } else {
                    char::from(b).to_string()
                }
            })
            .collect()
    }

    proptest! {
        /// Any spelling of a path is refused, or the gateway reads it as the path it
        /// spells, and so does a lenient upstream: no spelling reaches a route's handler
        /// under another route's policy.
        #[test]
        fn no_spelling_escapes_its_route(
            parts in proptest::collection::vec(
                (segment(), twist(), any::<u64>(), any::<bool>()),
                1..6,
            ),
            final_slash in any::<bool>(),
        ) {
            let canonical: String = parts.iter().map(|(s, ..)| format!("/{s}")).collect();
            let mut spelled = String::new();
            for (seg, twist, encode, lower) in &parts {
                let mut seg = spell_segment(seg, *encode, *lower);
                match twist {
                    Twist::None => {}
                    Twist::Dot => spelled.push_str("/."),
                    Twist::Up(x) => spelled.push_str(&format!("/{x}/..")),
                    Twist::Double => spelled.push('/'),
                    Twist::EncodedDot(true) => spelled.push_str("/%2e"),
                    Twist::EncodedDot(false) => spelled.push_str("/x/%2E%2E"),
                    Twist::Param => seg.push_str(";x"),
                    Twist::Separator(true) => seg.insert_str(0, "x%2F"),
                    Twist::Separator(false) => seg.insert_str(0, "x\\"),
                }
                spelled.push('/');
                spelled.push_str(&seg);
            }
            if final_slash {
                spelled.push('/');
            }
            let refused = parts.iter().any(|(_, t, ..)| t.refused());
            match normalize(&spelled) {
                Ok(normal) => {
                    prop_assert!(!refused, "{spelled} was not refused");
                    let slash = if final_slash { "/" } else { "" };
                    prop_assert_eq!(&normal, &format!("{canonical}{slash}"), "{}", spelled);
                    prop_assert_eq!(route_of(&normal), route_of(&canonical), "{}", spelled);
                    prop_assert_eq!(route_of(&lenient(&spelled)), route_of(&normal));
                    prop_assert_eq!(normalize(&normal), Ok(normal));
                }
                Err(e) => prop_assert!(refused, "{spelled} refused: {e}"),
            }
        }

        /// The same for any string of the characters that make paths ambiguous.
        #[test]
        fn no_odd_path_escapes_its_route(raw in "(/|v1|payments|a|b|x|\\.|%|2|e|E|f|F|5|c|C|;|\\\\|~)*") {
            let raw = format!("/{raw}");
            if let Ok(normal) = normalize(&raw) {
                prop_assert_eq!(route_of(&lenient(&raw)), route_of(&normal), "{}", raw);
                prop_assert_eq!(normalize(&normal), Ok(normal));
            }
        }
    }
}

#[test]
fn anonymous_callers_are_refused_unless_a_route_shares() {
    let t = Duration::from_secs(30);
    let none = RouteSettings::default();
    let shared: RouteSettings = toml::from_str("anonymous = \"shared\"").unwrap();
    let refuse: RouteSettings = toml::from_str("anonymous = \"refuse\"").unwrap();
    let of = |r, d| route(r, d, t).unwrap().anonymous;
    assert_eq!(of(&none, &none), Anonymous::Refuse);
    assert_eq!(of(&none, &shared), Anonymous::Shared, "from [defaults]");
    assert_eq!(of(&refuse, &shared), Anonymous::Refuse);
    let bad: RouteSettings = toml::from_str("anonymous = \"open\"").unwrap();
    assert!(
        route(&bad, &none, t)
            .unwrap_err()
            .contains("refuse or shared")
    );
}

#[test]
fn routes_inherit_defaults() {
    let file = FileConfig::parse(
        r#"
        upstream = "http://127.0.0.1:1"
        [defaults]
        key = "required"
        ttl = "1h"
        [[route]]
        path = "/pay/**"
        preset = "stripe"
        wait = "2s"
        methods = ["post", "put"]
        "#,
    )
    .unwrap();
    let t = Duration::from_secs(30);
    let route = policy(&file.routes[0], &file.defaults, t).unwrap();
    assert_eq!(route.key, KeyRequirement::Required);
    assert_eq!(route.preset, Preset::Stripe);
    assert_eq!(route.ttl, Duration::from_secs(3600));
    assert_eq!(route.in_flight, InFlight::Wait(Duration::from_secs(2)));
    assert_eq!(route.methods, [Method::POST, Method::PUT]);
    assert!(route.lease > t);
    let default = policy(&file.defaults, &RouteSettings::default(), t).unwrap();
    assert_eq!(default.preset, Preset::Ietf);
}

#[test]
fn bad_settings_are_explained() {
    let t = Duration::from_secs(30);
    let d = RouteSettings::default();
    for (toml, needle) in [
        ("key = \"maybe\"", "required or optional"),
        ("preset = \"paypal\"", "ietf or stripe"),
        ("lease = \"10s\"", "longer than upstream_timeout"),
        ("ttl = \"soon\"", "ttl"),
        ("on_unknown = \"retry\"", "hold or release_after_lease"),
        ("fingerprint_json_fields = [\"amount\"]", "JSON Pointer"),
        ("methods = [\"PO ST\"]", "not an HTTP method"),
        ("namespace = \"a b\"", "namespace"),
        ("methods = []", "at least one method"),
        (
            "fingerprint_json_fields = []",
            "every JSON body would match",
        ),
        ("ttl = \"1000y\"", "at most"),
        ("lease = \"300000000000y\"", "at most"),
        ("wait = \"2d\"", "at most"),
    ] {
        let route: RouteSettings = toml::from_str(toml).unwrap();
        let err = policy(&route, &d, t).unwrap_err();
        assert!(err.contains(needle), "{toml}: {err}");
    }
    assert!(FileConfig::parse("unknown_setting = 1").is_err());
    assert!(FileConfig::parse("[[route]]\npath = \"/a\"\nkeys = \"required\"").is_err());
}
