//! Text for headers: what a dead-lettered copy says about why, within the broker's bounds.

/// `text` cut to at most `max` bytes, at a character boundary.
pub(crate) fn cut(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// `text` on one line (each control character a space, so that no line break ends a header
/// early), cut to at most `max` bytes at a character boundary.
#[cfg(any(feature = "nats", feature = "redis-streams", feature = "kafka"))]
pub(crate) fn one_line(text: &str, max: usize) -> String {
    let line: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    cut(&line, max).to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn details_are_cut_at_a_character_boundary() {
        assert_eq!(cut("abc", 5), "abc");
        assert_eq!(cut("aé", 2), "a");
        assert_eq!(cut("aéb", 3), "aé");
    }
}
