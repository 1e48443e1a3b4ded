package main

import (
	"bytes"
	"strings"
	"testing"
)

func TestReportCopiesTheOutputAndListsTheSlowest(t *testing.T) {
	in := strings.Join([]string{
		`{"Action":"run","Package":"p","Test":"TestA"}`,
		`{"Action":"output","Package":"p","Test":"TestA","Output":"=== RUN   TestA\n"}`,
		`{"Action":"pass","Package":"p","Test":"TestA","Elapsed":1.5}`,
		`{"Action":"pass","Package":"p","Test":"TestA/sub","Elapsed":1.4}`,
		`{"Action":"pass","Package":"p","Test":"TestB","Elapsed":3}`,
		`{"Action":"skip","Package":"p","Test":"TestC","Elapsed":0}`,
		`# some/package`,
		`{"Action":"output","Package":"p","Output":"ok  \tp\t4.5s\n"}`,
		`{"Action":"pass","Package":"p","Elapsed":4.5}`,
	}, "\n")
	var out bytes.Buffer
	code, err := report(strings.NewReader(in), &out, 2)
	if err != nil || code != 0 {
		t.Fatalf("code %d, err %v", code, err)
	}
	want := "# some/package\nok  \tp\t4.5s\n\n2 slowest tests:\n        3s  p TestB\n      1.5s  p TestA\n\n1 slowest packages:\n      4.5s  p\n"
	if out.String() != want {
		t.Errorf("output:\n%q\nwant:\n%q", out.String(), want)
	}
}

func TestAFailedTestFailsTheReportAndShowsItsOutput(t *testing.T) {
	in := strings.Join([]string{
		`{"Action":"output","Package":"p","Test":"TestA","Output":"a.go:1: boom\n"}`,
		`{"Action":"output","Package":"p","Test":"TestB","Output":"b.go:1: fine\n"}`,
		`{"Action":"pass","Package":"p","Test":"TestB","Elapsed":1}`,
		`{"Action":"fail","Package":"p","Test":"TestA","Elapsed":1}`,
		`{"Action":"fail","Package":"p","Elapsed":1}`,
	}, "\n")
	var out bytes.Buffer
	if code, _ := report(strings.NewReader(in), &out, 0); code != 1 {
		t.Errorf("code %d after a failure, want 1", code)
	}
	if out.String() != "a.go:1: boom\n" {
		t.Errorf("output %q, want the failed test's only", out.String())
	}
}
