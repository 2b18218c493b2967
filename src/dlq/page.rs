//! A stable, oldest-first order over dead letters, and pages of it.
//!
//! A queue has no order an operator can page through: a pass hands back what it did not remove,
//! and a quorum queue may put those messages behind the others. So a listing reads the whole DLQ
//! (bounded by its depth at the start), sorts it by when each letter died, then by id, and cuts
//! the page from that order. The same DLQ therefore lists the same way however often it is
//! listed, and a cursor (the sort key of the last letter shown) finds the next page even when
//! letters before it were requeued or purged in between.

use super::letter::DeadLetter;

/// Which part of the oldest-first order a listing shows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Page {
    /// Show letters after this one (a cursor from [`super::Listing::next`]); `None` starts at
    /// the oldest.
    pub after: Option<Cursor>,
    /// At most this many letters (copies with the same key as the last one shown are kept
    /// together, so a page may hold a few more).
    pub limit: usize,
}

impl Page {
    /// The oldest `limit` letters.
    pub fn first(limit: usize) -> Self {
        Self { after: None, limit }
    }

    /// Every letter, for counting and selecting.
    pub fn all() -> Self {
        Self::first(usize::MAX)
    }
}

/// Where a page ended: the time of death (microseconds) and id of its last letter.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Cursor {
    micros: i64,
    id: String,
}

impl Cursor {
    /// The sort key of `letter`; a letter without a time of death sorts first.
    pub fn of(letter: &DeadLetter) -> Self {
        let micros = letter
            .failed_at
            .as_deref()
            .and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok())
            .map_or(0, |t| t.timestamp_micros());
        Self {
            micros,
            id: letter.id.clone(),
        }
    }

}

/// Text that is not a cursor a listing handed out (forged, cut short, or from elsewhere); its
/// words are the CLI's, the API and the console say it their way.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "not a cursor `dlq list` printed; copy the one after `--after` at the end of the previous page (or `next` in its --json)"
)]
pub struct NotACursor;

/// Reads a cursor a listing handed out (`<micros>.<id>`): the CLI's `--after`, the API's and
/// the console's `after`.
impl std::str::FromStr for Cursor {
    type Err = NotACursor;

    fn from_str(text: &str) -> Result<Self, NotACursor> {
        let (micros, id) = text.split_once('.').ok_or(NotACursor)?;
        if id.is_empty() {
            return Err(NotACursor);
        }
        Ok(Self {
            micros: micros.parse().map_err(|_| NotACursor)?,
            id: id.to_owned(),
        })
    }
}

impl std::fmt::Display for Cursor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.micros, self.id)
    }
}

/// Sorts `letters` oldest first and cuts `page` from them: the letters shown, and the cursor of
/// the next page when more follow.
pub(super) fn cut(mut letters: Vec<DeadLetter>, page: &Page) -> (Vec<DeadLetter>, Option<Cursor>) {
    letters.sort_by_cached_key(Cursor::of);
    let start = match &page.after {
        Some(after) => letters.partition_point(|l| Cursor::of(l) <= *after),
        None => 0,
    };
    let mut shown: Vec<DeadLetter> = letters.drain(start..).collect();
    let mut end = page.limit.min(shown.len());
    // Copies of one message share a key: they stay on one page, or the cursor would skip some.
    if let Some(last) = end.checked_sub(1).map(|i| Cursor::of(&shown[i])) {
        while end < shown.len() && Cursor::of(&shown[end]) == last {
            end += 1;
        }
    }
    let more = end < shown.len();
    shown.truncate(end);
    let next = more.then(|| shown.last().map(Cursor::of)).flatten();
    (shown, next)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn letter(id: &str, failed_at: Option<&str>) -> DeadLetter {
        let mut l = DeadLetter::read(Some(id), None, "", b"{}", 5);
        l.failed_at = failed_at.map(str::to_owned);
        l
    }

    fn ids(letters: &[DeadLetter]) -> Vec<&str> {
        letters.iter().map(|l| l.id.as_str()).collect()
    }

    fn three() -> Vec<DeadLetter> {
        vec![
            letter("c", Some("2026-11-30T10:00:02+00:00")),
            letter("a", Some("2026-11-30T10:00:01+00:00")),
            letter("b", Some("2026-11-30T10:00:01+00:00")),
        ]
    }

    #[test]
    fn pages_follow_the_time_of_death_then_the_id_whatever_the_queue_order() {
        let (page, next) = cut(three(), &Page::first(2));
        assert_eq!(ids(&page), ["a", "b"]);
        let after = next.expect("a third letter follows").to_string().parse().ok();
        let (rest, next) = cut(three(), &Page { after, limit: 2 });
        assert_eq!(ids(&rest), ["c"]);
        assert_eq!(next, None);
    }

    #[test]
    fn a_cursor_still_works_when_its_letter_is_gone() {
        let after = Some(Cursor::of(&three()[1]));
        let without_a: Vec<_> = three().into_iter().filter(|l| l.id != "a").collect();
        let (page, _) = cut(without_a, &Page { after, limit: 5 });
        assert_eq!(ids(&page), ["b", "c"]);
    }

    #[test]
    fn copies_of_one_message_stay_on_one_page() {
        let mut letters = three();
        letters.push(letter("a", Some("2026-11-30T10:00:01+00:00")));
        let (page, next) = cut(letters, &Page::first(1));
        assert_eq!(ids(&page), ["a", "a"]);
        assert!(next.is_some());
    }

    #[test]
    fn a_forged_cursor_is_not_a_cursor() {
        for bad in ["", "abc", "12", "12.", "x.id"] {
            assert_eq!(bad.parse::<Cursor>(), Err(NotACursor), "{bad:?}");
        }
        assert_eq!(
            "-5.m.1".parse::<Cursor>().map(|c| c.to_string()),
            Ok("-5.m.1".to_owned())
        );
    }
}
