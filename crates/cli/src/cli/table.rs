//! The CLI's tables: columns as wide as their widest cell, numbers right-aligned, no borders, so
//! that they line up whatever the ids and names are and still paste as plain text.

use comfy_table::{CellAlignment, ContentArrangement, Table, presets};

/// A table with these headers; the columns named in `numeric` are right-aligned.
pub fn new(headers: &[&str], numeric: &[&str]) -> Table {
    let mut table = Table::new();
    table
        .load_style(presets::NOTHING)
        .set_content_arrangement(ContentArrangement::Disabled)
        .set_header(headers.to_vec());
    for (i, header) in headers.iter().enumerate() {
        if numeric.contains(header)
            && let Some(column) = table.column_mut(i)
        {
            column.set_cell_alignment(CellAlignment::Right);
        }
    }
    table
}

/// Prints `table` with the trailing spaces of each line trimmed.
pub fn print(table: &Table) {
    for line in table.lines() {
        println!("{}", line.trim_end());
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn columns_line_up_whatever_the_widths() {
        let mut t = super::new(&["id", "tries", "detail"], &["tries"]);
        t.add_row(vec![
            "a-very-long-message-id-of-fifty-characters-or-more-x",
            "3",
            "d-one",
        ]);
        t.add_row(vec!["b", "12", "d-two"]);
        let lines: Vec<String> = t.lines().map(|l| l.trim_end().to_owned()).collect();
        let col = |l: &str, needle: &str| l.find(needle).expect("cell shown");
        assert_eq!(col(&lines[1], " 3 ") + 1, col(&lines[2], "12 ") + 1);
        assert_eq!(col(&lines[1], "d-one"), col(&lines[2], "d-two"));
    }
}
